"""Benchmarks: how the house itself is built and seen: the modules one request walks through, the operator page's screenshots."""
