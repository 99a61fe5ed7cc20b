"""Runtime: executor, offload engine, saved-tensor hooks and the guard (the public API)."""
