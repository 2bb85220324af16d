"""Cost accounting for DiT: FLOPs, peaks, MFU/HFU, memory and budgets; it knows model shapes, never the loop."""
