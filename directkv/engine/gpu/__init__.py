"""GPU executor: real model math with random weights, each system's KV path run for real, timed by CUDA events."""
