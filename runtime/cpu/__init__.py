"""Paths only MLX's CPU backend takes: attention with its softmax in NumPy, and KV copies
into new batch buffers through NumPy."""
