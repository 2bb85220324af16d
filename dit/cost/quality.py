"""Quality against compute from a run's ``metrics.jsonl``: the curve, and the compute, time and cost a target FID
took, interpolated in log(FLOPs) between the two evaluations that bracket it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dit.io.errors import UserError


def read_run(run_dir: str, up_to_step: int | None = None) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a run in step order, a step a resume repeated counted once."""
    path = Path(run_dir)
    path = path if path.suffix == ".jsonl" else path / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: pass a run's --results-dir.")
    records = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(
                f"{path}, line {n}, is not JSON: the file was damaged; repair or remove that line."
            ) from None
        if up_to_step is None or record["step"] <= up_to_step:
            records.pop((record.get("kind"), record["step"]), None)  # a repeat goes to the end, then sorts
            records[(record.get("kind"), record["step"])] = record
    ordered = sorted(records.values(), key=lambda r: r["step"])
    evals = [r for r in ordered if r.get("kind") == "eval"]
    if not evals:
        raise UserError(
            f"{path} holds no evaluations: train with --eval-every N --eval-ref REF to record quality."
        )
    return [r for r in ordered if r.get("kind") != "eval"], evals


def pflops_of(evaluation: dict, count: str = "model") -> float:
    """An evaluation's training compute so far: the DiT's (``model``), or with auxiliary and upstream FLOPs."""
    pflops = evaluation["total_model_pflops"]
    if count == "total":
        pflops += sum(evaluation.get(k) or 0.0 for k in ("total_aux_pflops", "upstream_pflops",
                                                          "feature_extraction_pflops"))  # fmt: skip
    return pflops


def compute_to_target(
    run_dir: str,
    target_fid: float,
    price_per_hour: float | None = None,
    up_to_step: int | None = None,
    count: str = "model",
    score: str = "fid",
) -> dict:
    """The compute, time and cost at which a run's ``score`` first reached ``target_fid`` (interpolated)."""
    train, evals = read_run(run_dir, up_to_step)
    points = [(e["step"], pflops_of(e, count), e[score]) for e in evals if e.get(score) is not None]
    if not points:
        raise UserError(f"{run_dir}'s evaluations have no {score} (its reference or sample count left it out).")
    key = "total_model" if count == "model" else "total"
    result = {
        "run": str(run_dir),
        "score": score,
        "target_fid": target_fid,
        "reached": False,
        "best_fid": min(f for _, _, f in points),
        "count": count,
        "evaluations": [{"step": s, f"{key}_pflops": p, score: f} for s, p, f in points],
    }
    hit = next((i for i, (_, _, f) in enumerate(points) if f <= target_fid), None)
    if hit is None:
        return result
    step, pflops = points[hit][:2]
    if hit > 0:  # between the previous evaluation (above the target) and this one, in log FLOPs
        (s0, p0, f0), (s1, p1, f1) = points[hit - 1], points[hit]
        w = (f0 - target_fid) / (f0 - f1)  # f0 > target >= f1
        pflops = math.exp(math.log(p0) + w * (math.log(p1) - math.log(p0))) if p0 > 0 else p0 + w * (p1 - p0)
        step = s0 + (pflops - p0) / (p1 - p0) * (s1 - s0) if p1 != p0 else s1  # FLOPs grow with steps
    r = next((r for r in reversed(train) if r.get("images_per_sec_per_device")), None)
    world = max(1, round(r["images_per_sec"] / r["images_per_sec_per_device"])) if r else 1
    seconds, last = 0.0, 0  # the MFU windows up to ``step`` (pauses and warm-up left out), the last pro rata
    for t in train:
        window = t.get("window_s") or 0.0
        if t["step"] > step:
            seconds += window * (step - last) / max(t["step"] - last, 1)
            break
        seconds += window
        last = t["step"]
    hours = seconds * world / 3600
    result.update(
        reached=True,
        upper_bound=hit == 0,
        step=step,
        **{f"{key}_pflops": pflops, f"{key}_flops": pflops * 1e15},
        training_seconds=seconds,
        devices=world,
        device_hours=hours,
        price_per_device_hour=price_per_hour,
        cost=hours * price_per_hour if price_per_hour is not None else None,
    )
    return result
