"""Planning: what the parent decides before any model runs (input checks, devices, index statistics).
Runs on a login node: never CUDA, never torch at import."""
