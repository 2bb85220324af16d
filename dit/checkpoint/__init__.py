"""Checkpoints: the one package that writes and reads them (``format``, ``sharded``, ``dcp_metadata``, ``lineage``,
``section``, ``checkpointer``, ``posthoc``: docs/architecture.md)."""

from dit.checkpoint.checkpointer import Checkpointer
from dit.checkpoint.format import (
    FORMAT,
    atomic_torch_save,
    checksum_path,
    expired_checkpoints,
    find_checkpoint,
    kept_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_training_checkpoint,
    model_weights,
    official_release,
    read_record,
    remove_checkpoint,
    remove_partial_checkpoints,
    save_training_checkpoint,
    verify_checkpoint,
)
from dit.checkpoint.section import CheckpointSection

__all__ = [
    "FORMAT", "CheckpointSection", "Checkpointer", "atomic_torch_save", "checksum_path", "expired_checkpoints",
    "find_checkpoint", "kept_checkpoints", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
    "load_training_checkpoint", "model_weights", "official_release", "read_record", "remove_checkpoint",
    "remove_partial_checkpoints", "save_training_checkpoint", "verify_checkpoint",
]  # fmt: skip
