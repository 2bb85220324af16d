"""dit-ledger: Diffusion Transformer training with cost as a first-class output."""

__version__ = "0.1.0"
