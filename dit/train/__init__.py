"""Training: ``TrainConfig`` (its sections), ``parse_train_config`` (train.py's flags), ``Trainer`` (the parts of a
run and its loop), ``train``."""

from dit.train.config import TRAIN_FACE, TrainConfig, parse_train_config
from dit.train.trainer import Trainer, train

__all__ = ["TRAIN_FACE", "TrainConfig", "Trainer", "parse_train_config", "train"]
