"""Training loop pieces, checkpoints, sampling and interop."""
