"""Model and hardware specs: frozen dataclasses found by exact name."""

from directkv.specs.hardware import HARDWARE, HardwareSpec, get_hardware
from directkv.specs.models import MODELS, ModelSpec, get_model

__all__ = ["HARDWARE", "MODELS", "HardwareSpec", "ModelSpec", "get_hardware", "get_model"]
