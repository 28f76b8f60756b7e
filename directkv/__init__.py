"""DirectKV reproduction harness: zero-copy KV-cache offloading, its baselines, and a calibrated simulation."""

__version__ = "0.1.0"
