import os

# Token counts do not matter for most tests; the real tokenizer is tested in test_workloads.py.
os.environ.setdefault("DIRECTKV_TOKENIZER", "approx")
