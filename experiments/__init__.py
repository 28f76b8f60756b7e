"""Experiments: `python -m experiments.run +exp=NAME [overrides]` (Hydra), one module per experiment kind."""
