"""Extraction: images -> VAE posterior moments -> a latent store (``extract.py``, ``stats.py``)."""

from dit.extract.extract import EXTRACT_FACE, ExtractConfig, extract_features

__all__ = ["EXTRACT_FACE", "ExtractConfig", "extract_features"]
