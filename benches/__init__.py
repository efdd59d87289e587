"""kvmem benchmarks; each runs as ``python -m benches.<name>``."""
