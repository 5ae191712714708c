"""Side rooms of the training loop: assembly, preflight checks, checkpoints, metrics, run lock, profiling,
report, console logging."""
