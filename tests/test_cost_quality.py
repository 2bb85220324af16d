"""dit-cost quality and plot quality: compute-to-target interpolated between evaluations, from metrics.jsonl."""

import json
import math

import pytest

from dit.cost.__main__ import main


def write_run(folder, fids=(100.0, 40.0, 10.0), pflops=(1.0, 2.0, 4.0), world=2):
    """Three evaluations at steps 100, 200, 400; a training record per 100 steps of 50 s each."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "kind": "train",
            "step": s,
            "window_s": 50.0,
            "images_per_sec": 8.0 * world,
            "images_per_sec_per_device": 8.0,
        }
        for s in (100, 200, 300, 400)
    ]
    rows += [
        {"kind": "eval", "step": s, "total_model_pflops": p, "fid": f, "precision": 0.5, "recall": 0.4}
        for s, p, f in zip((100, 200, 400), pflops, fids)
    ]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_compute_to_target_is_interpolated_in_log_flops(tmp_path, capsys):
    folder = write_run(tmp_path / "run")
    code, out, _ = run(capsys, "quality", folder, "--target-fid", 25, "--price-per-hour", 2, "--json")
    r = json.loads(out)
    assert code == 0 and r["reached"]
    w = (40 - 25) / (40 - 10)  # between the evaluations at 2 and 4 PFLOP
    assert r["total_model_pflops"] == pytest.approx(math.exp(math.log(2) + w * math.log(2)))
    assert r["step"] == pytest.approx(200 + (r["total_model_pflops"] - 2) / 2 * 200)  # FLOPs grow with steps
    assert r["training_seconds"] == pytest.approx(50 * 2 + 50 + 50 * (r["step"] - 300) / 100)
    assert not r["upper_bound"]
    assert r["devices"] == 2 and r["device_hours"] == pytest.approx(2 * r["training_seconds"] / 3600)
    assert r["cost"] == pytest.approx(2 * r["device_hours"])
    code, out, _ = run(capsys, "quality", folder, "--target-fid", 25, "--gpu", "H100-SXM", "--mfu", 0.5, "--json")
    planned = json.loads(out)["planned"]
    assert planned["seconds"] == pytest.approx(r["total_model_flops"] / (989.4e12 * 0.5))


def test_targets_reached_at_once_or_never(tmp_path, capsys):
    folder = write_run(tmp_path / "run")
    first = json.loads(run(capsys, "quality", folder, "--target-fid", 150, "--json")[1])
    assert first["reached"] and first["total_model_pflops"] == 1.0 and first["cost"] is None
    assert first["upper_bound"]  # reached at the first evaluation: the compute before it is unknown
    code, out, _ = run(capsys, "quality", folder, "--target-fid", 5)
    assert code == 0 and "not reached (best 10)" in out


def test_plot_and_bad_input(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", fids=(90.0, 30.0, 8.0))
    png = tmp_path / "fid.png"
    code, _, err = run(capsys, "plot", "quality", a, b, "--labels", "S", "B", "--out", png)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    code, _, err = run(capsys, "quality", tmp_path / "empty", "--target-fid", 10)
    assert code == 2 and "--eval-every" in err
    code, _, err = run(capsys, "quality", tmp_path / "nowhere", "--target-fid", 10)
    assert code == 2 and "no metrics.jsonl" in err
    code, _, err = run(capsys, "plot", "quality", a, "--labels", "x", "y", "--out", png)
    assert code == 2 and "one per run" in err


def test_a_run_trained_past_a_budget_is_read_up_to_it(tmp_path):
    """A study reuses a run that a larger budget continued: its answer at the old budget must not change."""
    from dit.cost.quality import compute_to_target

    folder = write_run(tmp_path / "run")
    assert compute_to_target(str(folder), 25.0)["reached"]
    cut = compute_to_target(str(folder), 25.0, up_to_step=200)
    assert not cut["reached"] and cut["best_fid"] == 40.0 and [e["step"] for e in cut["evaluations"]] == [100, 200]


def test_a_resumed_run_counts_each_step_once(tmp_path):
    """A resume appends the steps after the last checkpoint again; the later records count, in step order."""
    from dit.cost.quality import compute_to_target, read_run

    folder = write_run(tmp_path / "run")
    once = compute_to_target(str(folder), 25.0)
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    repeated = [ln for ln in lines if json.loads(ln)["step"] >= 300]  # killed after 200, resumed
    (folder / "metrics.jsonl").write_text("\n".join(lines + repeated) + "\n")
    train, evals = read_run(str(folder))
    assert [r["step"] for r in train] == [100, 200, 300, 400] and [e["step"] for e in evals] == [100, 200, 400]
    assert compute_to_target(str(folder), 25.0)["training_seconds"] == pytest.approx(once["training_seconds"])


def test_grouped_runs_share_a_colour_and_one_legend_entry(tmp_path, monkeypatch):
    """Runs of one recipe (its seeds) are one colour and one legend entry, so a study of many seeds reads."""
    from dit.cost import plots

    runs = [str(write_run(tmp_path / f"r{i}", fids=(100.0 - i, 40.0, 10.0))) for i in range(3)]
    seen = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: seen.setdefault("fig", fig) and path)
    plots.plot_quality(str(tmp_path / "q.png"), runs, groups=["baseline", "baseline", "blocks"])
    fid_axis = seen["fig"].axes[0]
    legend = [t.get_text() for t in fid_axis.get_legend().get_texts()]
    assert legend == ["baseline (2 seeds)", "blocks (1 seed)"]
    colours = [line.get_color() for line in fid_axis.get_lines()]
    assert colours[0] == colours[1] != colours[2]
