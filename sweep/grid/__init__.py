"""Grid sweeps: blocks of points through one jit(vmap), the plan and progress lines."""
