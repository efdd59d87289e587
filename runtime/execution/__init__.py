"""Running turns on the MLX thread: the engine, one sequence per turn, the decode batch,
prefill together, the shared-prefix check, standalone generation and the warm-up."""
