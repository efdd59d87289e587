"""Benchmarks: kvmem beside other servers on the same weights: the race (llama.cpp, mlx_lm.server), agent patterns, llama.cpp's own server tests, token-level agreement."""
