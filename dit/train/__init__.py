"""Training: ``TrainConfig`` (its sections), ``resolve`` (train.py's flags, a resume's record), ``Trainer`` (the parts
of a run and its loop), ``train``."""

from dit.train.config import TRAIN_FACE, TrainConfig, resolve
from dit.train.trainer import Trainer, train

__all__ = ["TRAIN_FACE", "TrainConfig", "Trainer", "resolve", "train"]
