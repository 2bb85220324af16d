"""Fine-tuning: a fresh run's model starts from released or trained weights (``--init-from``); what differs from
the source is adapted where that is well defined (docs/finetuning.md), any other difference is an error."""

from __future__ import annotations

import json
from pathlib import Path

from dit.checkpoint import load_checkpoint, model_weights
from dit.io.errors import UserError
from dit.model.dit import DiT

TABLE = "y_embedder.embedding_table.weight"


def init_from(model: DiT, path: str, weights: str = "ema", report: Path | None = None) -> str:
    """Load ``path``'s weights into a fresh ``model``; the start-up line, and the full list to ``report``."""
    use_ema = {"ema": True, "model": False}[weights]  # the choice (checked at --init-from-weights) picks them
    ckpt = load_checkpoint(path)
    source, which = model_weights(ckpt, use_ema=use_ema)
    if weights == "model" and which != "model":
        raise UserError(f"{path} holds no raw model weights (only {which}): pass --init-from-weights ema.")
    source = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in source.items()}
    own = model.state_dict()
    state, loaded, recomputed, reinitialised, problems = {}, [], [], [], []
    for name, mine in own.items():
        theirs = source.get(name)
        if theirs is None:
            problems.append(f"{name} missing")
        elif tuple(theirs.shape) == tuple(mine.shape):
            state[name] = theirs.to(mine.dtype)
            loaded.append(name)
        elif name == "pos_embed":  # the sin-cos table of the new grid, as the fresh model computed it
            state[name] = mine
            recomputed.append(f"pos_embed {tuple(theirs.shape)} -> {tuple(mine.shape)}")
        elif name == TABLE and theirs.shape[1] == mine.shape[1]:
            table = mine.clone()  # the fresh model's N(0, 0.02) rows for the new classes
            if model.config.class_dropout_prob > 0 and theirs.shape[0] > 1:
                table[-1] = theirs[-1]  # the learned unconditional row, at the new null index
            state[name] = table
            reinitialised.append(f"{TABLE} {tuple(theirs.shape)} -> {tuple(mine.shape)} (null row kept)")
        else:
            problems.append(f"{name}: {tuple(theirs.shape)} in {path}, {tuple(mine.shape)} in the model")
    extra = sorted(set(source) - set(own))
    if extra and not (extra == [TABLE] and model.y_embedder is None):  # unconditional: the table is dropped
        problems += [f"{name} unexpected" for name in extra]
    elif extra:
        reinitialised.append(f"{TABLE} dropped (the model is unconditional)")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} in all)" if len(problems) > 8 else "")
        raise UserError(
            f"--init-from {path} does not fit this model beyond its class count and input size: {shown}. Pass the "
            "--model (depth, width, patch), --learn-sigma and latent channels the weights were trained with."
        )
    model.load_state_dict(state, strict=True)
    if report is not None:
        listing = {"source": str(path), "weights": which, "loaded": loaded, "recomputed": recomputed,
                   "reinitialised": reinitialised}  # fmt: skip
        from dit.io.atomic import atomic_write_bytes

        atomic_write_bytes(report, json.dumps(listing, indent=1).encode())
    changed = "; ".join(recomputed + reinitialised) or "nothing resized or re-initialised"
    where = f"; every tensor listed in {report}" if report is not None else ""
    return f"initialised from {path} ({which} weights): {len(loaded)} tensors loaded; {changed}{where}"
