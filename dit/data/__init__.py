"""Data: image folders and arrays (``images``), the latent store's format (``store``) and reader (``reader``)."""
