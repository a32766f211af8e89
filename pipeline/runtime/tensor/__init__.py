"""Tensor parallelism inside a stage: a user's ``parallelize_fn`` over the stage's "tp" ranks, the
stage's boundary kept plain (parallel.py), and one for Llama-family blocks (llama.py)."""
