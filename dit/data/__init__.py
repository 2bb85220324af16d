"""Data: image folders and arrays (``images``) and the pre-extracted latent store (``latents``)."""
