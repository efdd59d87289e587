"""The pure plan and pools: what each turn reuses, what each GPU loop iteration does,
which cache is saved next, the block accounting, and the contract a turn's plan
travels to the engine under. Plain Python: no trio, no MLX (tests/house/test_layering.py)."""
