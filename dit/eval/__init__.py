"""Sample quality as the ADM evaluator defines it (FID, sFID, IS, precision/recall) plus a digit-classifier
metric that runs offline on a CPU; docs/evaluation.md has the definitions and their cost.

    net = load_feature_net("mnist")                    # or "inception" (weights downloaded or given)
    evaluator = Evaluator(net, load_reference("REF.npz"))
    scores = evaluator.evaluate(batches)               # NCHW uint8 or [-1, 1] batches, or (images, labels)"""

from dit.eval.evaluator import Evaluator
from dit.eval.features import load_feature_net
from dit.eval.reference import load_reference

__all__ = ["Evaluator", "load_feature_net", "load_reference"]
