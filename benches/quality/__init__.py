"""Benchmarks: what quantized KV does to the model's answers: perplexity, KL, needles, recall."""
