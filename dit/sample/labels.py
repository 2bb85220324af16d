"""The class labels of a sample set: ``balanced`` (N // C per class, the rest to seeded classes) or ``random`` (as
the official sample_ddp.py); image i's label depends only on (seed, i, N, C)."""

from __future__ import annotations

from dit.io.errors import UserError
from dit.runtime import Stream, mix_seed

LABEL_MODES = ("balanced", "random")
DEFAULT_LABELS = "balanced"
REMAINDER_RULE = (
    "one more image each for the first N mod C classes of a permutation of the classes seeded by the seed"
)
_CLASSES, _IMAGES = 0, 1  # the two keyed orders of a balanced set


def fid_label(seed: int, index: int, num_classes: int) -> int:
    """Image ``index``'s class in a ``random`` set: uniform like the official sample_ddp.py, but per image."""
    return mix_seed(Stream.LABEL, seed, index) % num_classes if num_classes else 0  # bias < classes / 2**63


def extra_classes(seed: int, num_samples: int, num_classes: int) -> list[int]:
    """The classes of a balanced set that get one image more than N // C (in class order)."""
    order = sorted(range(num_classes), key=lambda c: (mix_seed(Stream.LABEL_ORDER, seed, _CLASSES, c), c))
    return sorted(order[: num_samples % num_classes])


def balanced_labels(seed: int, num_samples: int, num_classes: int) -> list[int]:
    """Every image's class in a balanced set: the classes' counts laid out in a seeded order of the images."""
    per_class, extra = num_samples // num_classes, set(extra_classes(seed, num_samples, num_classes))
    counts = [c for c in range(num_classes) for _ in range(per_class + (c in extra))]
    order = sorted(range(num_samples), key=lambda i: (mix_seed(Stream.LABEL_ORDER, seed, _IMAGES, i), i))
    labels = [0] * num_samples
    for label, image in zip(counts, order):
        labels[image] = label
    return labels


def set_labels(mode: str, seed: int, num_samples: int, num_classes: int) -> list[int]:
    """The classes of images 0..N-1 of a set in ``mode`` (all 0 for an unconditional model)."""
    if not num_classes:
        return [0] * num_samples
    if mode == "random":
        return [fid_label(seed, i, num_classes) for i in range(num_samples)]
    return balanced_labels(seed, num_samples, num_classes)


def labels_record(mode: str, seed: int, num_samples: int, num_classes: int) -> dict:
    """What a set's record says about its labels: the mode and, for a balanced set, how N splits over C."""
    if mode != "balanced" or not num_classes:
        return {"labels": mode}
    counts = {
        "num_samples": num_samples,
        "num_classes": num_classes,
        "per_class": num_samples // num_classes,
        "remainder": num_samples % num_classes,
        "remainder_rule": REMAINDER_RULE,
        "extra_classes": extra_classes(seed, num_samples, num_classes),
    }
    return {"labels": mode, "label_counts": counts}


def resumed_mode(asked: str | None, recorded: str | None, where, elsewhere: str) -> str:
    """The mode a set continues in: its ``recorded`` one (a new set takes ``asked``); the other mode is refused."""
    if recorded is None:
        return asked or DEFAULT_LABELS
    if asked is not None and asked != recorded:
        raise UserError(
            f"{where} was made with {recorded} labels, not {asked}: pass --labels {recorded} (or no --labels) to "
            f"continue it, or {elsewhere} for a set with {asked} labels."
        )
    return recorded
