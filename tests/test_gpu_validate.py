"""scripts/gpu_validate.sh: the dry run on the CPU writes every section's record, a failing section does not
stop the others, a process that dies or times out still gets a record, and without a GPU the real run refuses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_validate  # noqa: E402


def _script(*args, **kw):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", "scripts/gpu_validate.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, **kw)  # fmt: skip


@pytest.mark.slow
def test_dry_run_records_every_section_and_goes_on_past_a_failure(tmp_path):
    done = _script("--dry-run", "--out", str(tmp_path), "--fail", "flags", timeout=900)
    assert done.returncode == 1, done.stderr  # the forced failure
    data = json.loads((tmp_path / "gpu_validate.json").read_text())
    assert data["dry_run"] and data["complete"]
    records = {r["name"]: r for r in data["sections"]}
    assert list(records) == list(gpu_validate.SECTIONS)
    assert records["flags"]["status"] == "failed" and "made to fail" in records["flags"]["error"]
    for name in set(gpu_validate.SECTIONS) - {"flags"}:  # every later section ran anyway
        assert records[name]["status"] == "ok", (name, records[name])
        assert records[name]["seconds"] > 0
    env, numerics, sync = records["env"]["figures"], records["numerics"]["figures"], records["sync"]["figures"]
    assert env["torch"] == torch.__version__ and env["peak_bf16_tflops"] > 0 and env["peak_source"] == "table"
    for precision in ("fp32", "bf16"):
        block = numerics[f"block_{precision}"]
        assert set(block) == {"eager", "compiled", "checkpoint_of_compiled", "compiled_checkpoint"}
        assert all(v["max_rel_error_vs_fp64"] >= 0 for v in block.values())
    assert "math_fp32" in numerics["sdpa"] and numerics["sdpa"]["math_fp32"]["output_max_abs_diff_vs_fp64"] >= 0
    assert set(numerics["torch_logs"]) == {"recompiles", "graph_breaks"}
    assert "sync_debug_mode" in sync["skipped_parts"]  # CUDA-only: skipped, with its reason
    assert all(
        sync["nan_batch"][k] for k in ("weights_unchanged", "ema_unchanged", "optimizer_step_counts_unchanged")
    )
    assert sync["nan_batch"]["nonfinite_steps_counted"] == 1
    bench = records["bench"]["figures"]
    measured, unfit = bench["rows"]
    assert measured["status"] == "ok" and measured["images_per_sec"] > 0 and measured["mfu"] > 0
    assert unfit["status"] == "skipped" and "dit-cost memory estimates" in unfit["reason"]
    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [r["name"] for r in lines] == [r["name"] for r in bench["rows"]]  # a row at a time
    assert json.loads((tmp_path / "bench" / "b2_compile_off.json").read_text())["complete"]
    e2e = records["e2e"]["figures"]
    assert e2e["resumed"] and e2e["steps_logged"][-1] == 40 and [r["exit_status"] for r in e2e["runs"]] == [0, 0]
    assert e2e["ledger_mfu"] > 0 and e2e["estimate_gib"] > 0 and len(e2e["save_seconds"]) == 2
    assert "max_memory_reserved" in e2e["skipped_parts"]
    assert records["sample"]["figures"]["images_per_sec"] > 0
    for name in gpu_validate.SECTIONS:
        assert (tmp_path / "logs" / f"{name}.log").exists()


def test_a_section_that_wrote_nothing_gets_a_timeout_or_failed_record(tmp_path):
    (tmp_path / "sections").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "bench.log").write_text("step 1\nKilled\n")
    gpu_validate.main(["finish", "bench", "--out", str(tmp_path), "--rc", "124", "--seconds", "195"])
    gpu_validate.main(["finish", "e2e", "--out", str(tmp_path), "--rc", "139", "--seconds", "3"])
    ok = {"name": "env", "status": "ok", "seconds": 1.0, "figures": {"torch": "x"}}
    (tmp_path / "sections" / "env.json").write_text(json.dumps(ok))
    gpu_validate.main(["finish", "env", "--out", str(tmp_path), "--rc", "0", "--seconds", "1"])
    data = json.loads((tmp_path / "gpu_validate.json").read_text())
    records = {r["name"]: r for r in data["sections"]}
    assert [r["name"] for r in data["sections"]] == ["env", "bench", "e2e"] and not data["complete"]
    assert records["bench"]["status"] == "timeout" and "Killed" in records["bench"]["log_tail"]
    assert records["e2e"]["status"] == "failed" and "139" in records["e2e"]["error"]
    assert records["env"] == ok  # a record the section wrote is kept as it is


def test_recompiles_and_graph_breaks_are_captured():
    def f(x):
        print("a graph break")
        return x * 2

    with gpu_validate._Captured() as captured:
        compiled = torch.compile(f, backend="eager")
        compiled(torch.ones(3))
        compiled(torch.ones(3, 4))  # another rank: a recompile
    assert captured.lines["graph_breaks"] and any("rank" in line for line in captured.lines["recompiles"])


def test_a_section_that_raises_records_why(tmp_path):
    assert gpu_validate.main(["sample", "--out", str(tmp_path), "--dry-run", "--fail"]) == 1
    record = json.loads((tmp_path / "sections" / "sample.json").read_text())
    assert record["status"] == "failed" and record["error"] == "RuntimeError: made to fail (--fail)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_the_real_run_refuses_without_a_gpu(tmp_path):
    done = _script("--out", str(tmp_path), timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: no CUDA device") and "--dry-run" in line
    assert not (tmp_path / "gpu_validate.json").exists()
