"""Training: ``TrainConfig`` (the flags), ``Trainer`` (the parts of a run and its loop), ``train``."""

from dit.train.config import TrainConfig
from dit.train.trainer import Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
