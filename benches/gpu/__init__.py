"""Benchmarks: what runs on a lent GPU machine (issue 33's session), and one model over several ranks."""
