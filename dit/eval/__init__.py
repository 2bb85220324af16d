"""Sample quality as the ADM evaluator defines it (FID, sFID, IS, precision/recall) plus a digit-classifier
metric that runs offline on a CPU; docs/evaluation.md has the definitions, their cost and an example."""

from dit.eval.evaluator import Evaluator
from dit.eval.features import load_feature_net
from dit.eval.reference import load_reference

__all__ = ["Evaluator", "load_feature_net", "load_reference"]
