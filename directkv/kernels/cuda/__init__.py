"""CUDA backend: kernels in csrc/, one pybind11 module per op, built on first use and cached by source hash."""
