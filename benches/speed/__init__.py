"""Benchmarks: throughput and latency: batching, TTFT by tier, staggered arrivals, decode runs, attention kernels, cache I/O, memory, costs."""
