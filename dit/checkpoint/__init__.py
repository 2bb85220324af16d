"""Checkpoints: the one package that writes and reads them.

``format`` (one file: atomic writes, checksums, safe loads, listing, retention, official files), ``sharded``
(an FSDP run's folder of shards, torch.distributed.checkpoint), ``dcp_metadata`` (its ``.metadata``, read
safely), ``lineage`` (a run folder's branches), ``section`` (``CheckpointSection``), ``checkpointer`` (what a
run calls: save, snapshot, restore, wait), ``posthoc`` (post-hoc EMA: the profiles' math, the snapshots, the
reconstruction). ``python -m dit.checkpoint export`` turns a sharded folder into one file; ``ema`` rebuilds an
EMA of any length from a run's snapshots.
"""

from dit.checkpoint.checkpointer import Checkpointer
from dit.checkpoint.format import (
    FORMAT,
    OFFICIAL_RELEASES,
    SHARDED,
    atomic_torch_save,
    checkpoint_path,
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
    "FORMAT", "OFFICIAL_RELEASES", "SHARDED", "CheckpointSection", "Checkpointer", "atomic_torch_save",
    "checkpoint_path", "checksum_path", "expired_checkpoints", "find_checkpoint", "kept_checkpoints",
    "latest_checkpoint", "list_checkpoints", "load_checkpoint", "load_training_checkpoint", "model_weights",
    "official_release", "read_record", "remove_checkpoint", "remove_partial_checkpoints", "save_training_checkpoint",
    "verify_checkpoint",
]  # fmt: skip
