"""Decoder stacks (Llama, OPT) with random weights at real shapes; the KV path is the caller's `attend`."""

from directkv.model.runner import AttendFn, ModelRunner, sample_greedy
from directkv.model.weights import LayerWeights, Weights, init_weights, weight_bytes, weight_params

__all__ = ["AttendFn", "LayerWeights", "ModelRunner", "Weights", "init_weights", "sample_greedy",
           "weight_bytes", "weight_params"]
