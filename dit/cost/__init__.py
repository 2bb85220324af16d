"""Cost accounting for DiT: FLOPs, peaks, MFU/HFU, memory and budgets. Knows model shapes, never the loop.

- ``analytic``: closed-form FLOPs and parameters per image, by component (training, HFU, sampling, VAE).
- ``measured``: FlopCounterMode on the meta device and fvcore, the checks on ``analytic``.
- ``peaks``: dense peak FLOP/s per device and dtype, name matching, measured fallback, overrides.
- ``meter``: ``CostMeter``, host-side counters that turn into MFU/HFU once per logging window.
- ``memory``: analytic and traced (FakeTensor + MemTracker) training memory; largest batch that fits.
- ``plan``: training and sampling budgets; ``plots``: charts; ``__main__``: the ``dit-cost`` CLI.
"""
