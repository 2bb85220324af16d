"""The model (core layer, no I/O): ``config`` (DiTConfig, sizes, the model flags; no torch), ``options`` (the
block options' registries with their cost and memory terms; no torch), ``layers`` (blocks, embedders,
attention, MLPs), ``dit`` (DiT, DiT_models) and ``projector`` (REPA's projector and loss). Import the
submodules: this package imports nothing, so that ``dit.cost`` reads the config without loading torch."""
