"""The KV cache's forms on the MLX thread: parked (Q4 at rest, float kept where it pays),
active, the Q4 caches one sequence and a batch decode over, and the packed Q4 format."""
