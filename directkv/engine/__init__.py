"""Serving engine: one scheduler, systems (policies), and executors (simulation now, GPU later)."""
