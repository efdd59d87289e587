"""Benchmarks: what is kept and what is refused: kill -9 trials, fuzzing, tenants, load without cross-talk, huge prompts, the shared tier."""
