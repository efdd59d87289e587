"""Models and tokenizers: a loaded model (mlx-lm, or a GGUF file), the embedded default,
the tiny random models the tests use, and tokenizers built offline."""
