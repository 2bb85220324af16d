"""scripts/gpu_validate.sh: the dry run on the CPU writes every section's record, a failing section does not
stop the others, a process that dies or times out still gets a record, what it leaves in --out fits what the
device machine returns (at most 8 files, two folders deep, 16 MiB each), the GPU run's limits fit its lease,
and without a GPU (or without --out) the real run refuses."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_checks  # noqa: E402
import gpu_context  # noqa: E402
import gpu_train_checks  # noqa: E402
import gpu_validate  # noqa: E402


def _script(*args, env_extra=None, **kw):
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", "scripts/gpu_validate.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, **kw)  # fmt: skip


RETURN_FILES, RETURN_DEPTH, RETURN_BYTES = 8, 2, 16 * 2**20  # what the device machine brings back from $OUT


def _check_returnable(out: Path) -> None:
    files = [p for p in out.rglob("*") if not p.is_dir()]
    assert 0 < len(files) <= RETURN_FILES, files
    for p in files:
        assert p.is_file() and not p.is_symlink(), p
        assert len(p.relative_to(out).parts) - 1 <= RETURN_DEPTH, p
        assert p.stat().st_size <= RETURN_BYTES, (p, p.stat().st_size)


@pytest.mark.slow
def test_dry_run_records_every_section_and_goes_on_past_a_failure(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    done = _script(
        "--dry-run", "--out", str(out), "--fail", "flags", timeout=1800, env_extra={"TMPDIR": str(scratch)}
    )
    assert done.returncode == 1, done.stderr  # the forced failure
    _check_returnable(out)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_validate.json", "logs.tar.gz"]
    assert list(scratch.iterdir()) == []  # the scratch folder is gone
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(f"logs/{name}.log" for name in gpu_validate.SECTIONS)
    data = json.loads((out / "gpu_validate.json").read_text())
    assert data["dry_run"] and data["complete"]
    records = {r["name"]: r for r in data["sections"]}
    assert list(records) == list(gpu_validate.SECTIONS)
    assert records["flags"]["status"] == "failed" and "made to fail" in records["flags"]["error"]
    for name in set(gpu_validate.SECTIONS) - {"flags"}:  # every later section ran anyway
        assert records[name]["status"] == "ok", (name, records[name])
        assert records[name]["seconds"] > 0
    env, numerics, sync = records["env"]["figures"], records["numerics"]["figures"], records["sync"]["figures"]
    assert env["torch"] == torch.__version__ and env["peak_bf16_tflops"] > 0 and env["peak_source"] == "table"
    assert set(numerics["block_fp32"]) == {"eager", "checkpointed_compiled"}
    assert set(numerics["block_bf16"]) == {"eager", "compiled", "checkpointed_compiled", "checkpoint_of_compiled"}
    for precision in ("fp32", "bf16"):
        assert all(v["max_rel_error_vs_fp64"] >= 0 for v in numerics[f"block_{precision}"].values())
    assert "math_fp32" in numerics["sdpa"] and numerics["sdpa"]["math_fp32"]["output_max_abs_diff_vs_fp64"] >= 0
    assert set(numerics["torch_logs"]) == {"recompiles", "graph_breaks"}
    assert "sync_debug_mode" in sync["skipped_parts"]  # CUDA-only: skipped, with its reason
    assert all(
        sync["nan_batch"][k] for k in ("weights_unchanged", "ema_unchanged", "optimizer_step_counts_unchanged")
    )
    assert sync["nan_batch"]["nonfinite_steps_counted"] == 1
    parallel = records["parallel"]["figures"]
    assert parallel["backend"] == "gloo" and parallel["ddp"]["wrapped"] == "DistributedDataParallel"
    assert parallel["ddp"]["weights_equal_to_one_process"] and parallel["fsdp"]["max_rel_loss_gap"] < 0.05
    assert all(parallel["dcp"][k] for k in ("resumed_equal", "next_step_losses_equal", "after_next_step_equal"))
    assert records["parallel"]["compiles"]["graphs"] > 0  # the trainer's blocks were compiled
    bench = records["bench"]["figures"]
    measured, compiled, unfit = bench["rows"]
    assert measured["status"] == "ok" and measured["images_per_sec"] > 0 and measured["mfu"] > 0
    assert compiled["status"] == "ok" and compiled["checkpointed_blocks"] == 12
    assert unfit["status"] == "skipped" and "dit-cost memory estimates" in unfit["reason"]
    e2e = records["e2e"]["figures"]
    assert e2e["resumed"] and e2e["resume_bit_for_bit"] and e2e["steps_logged"][-1] == 20
    assert [r["exit_status"] for r in e2e["runs"]] == [0, 0] and len(e2e["save_seconds"]) == 3
    assert e2e["ledger_mfu"] > 0 and e2e["estimate_gib"] > 0
    assert "max_memory_reserved" in e2e["skipped_parts"]
    assert records["sample"]["figures"]["images_per_sec"] > 0


def test_what_comes_back_fits_the_device_return_rules(tmp_path):
    """Every section recorded (one of them dead), each with a log longer than a returned file may be: DIR holds
    the JSON of every record and one capped log archive, nothing else."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "sections").mkdir(parents=True)
    (work / "logs").mkdir()
    for i, name in enumerate(gpu_validate.SECTIONS):
        (work / "logs" / f"{name}.log").write_bytes(os.urandom(3 * 2**20))  # incompressible, 24 MiB in all
        if name != "bench":  # bench died without a record
            record = {"name": name, "status": "ok", "seconds": 1.0, "figures": {"i": i}}
            (work / "sections" / f"{name}.json").write_text(json.dumps(record))
        rc = 137 if name == "bench" else 0
        assert gpu_validate.main(["finish", name, "--work", str(work), "--out", str(out), "--rc", str(rc),
                                  "--seconds", "2"]) == 0  # fmt: skip
    _check_returnable(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_validate.RETURNED)
    data = json.loads((out / "gpu_validate.json").read_text())
    assert data["complete"] and [r["name"] for r in data["sections"]] == list(gpu_validate.SECTIONS)
    assert {r["name"]: r["status"] for r in data["sections"]}["bench"] == "timeout"
    with tarfile.open(out / "logs.tar.gz") as tar:
        sizes = {m.name: m.size for m in tar.getmembers()}
    assert sizes == {f"logs/{name}.log": gpu_validate.LOG_TAIL_BYTES for name in gpu_validate.SECTIONS}


def test_the_gpu_run_fits_its_lease_with_a_rerun_to_spare():
    """The GPU sections' limits, with the seconds each may take to die, stay under the 420 s that leave a
    rerun inside the device's 10-minute command limit; every section has one."""
    text = (ROOT / "scripts" / "gpu_validate.sh").read_text()
    (line,) = [x for x in text.splitlines() if x.strip().startswith("flag=() limits=(")]
    limits = dict(e.split(":") for e in line.split("limits=(")[1].rstrip(")").split())
    kill = int(re.search(r"timeout -k (\d+)", text).group(1))
    assert list(limits) == list(gpu_validate.SECTIONS)
    assert sum(int(v) + kill for v in limits.values()) <= 400


def test_the_device_plan_runs_what_the_trainer_runs():
    """The bench plan on a GPU has a compiled row with checkpointed blocks; the numerics have the trainer's
    block (checkpointed inside, compiled) beside an outer checkpoint of a compiled block."""
    ctx = gpu_context.Ctx.__new__(gpu_context.Ctx)
    ctx.cuda, ctx.skipped = True, {}
    plan, common = gpu_train_checks._bench_plan(ctx)
    assert {"compile": "on", "checkpointing": "all"}.items() <= plan[-1].items()
    assert common[common.index("--model") + 1] == "DiT-XL/2"
    from dit.model.config import DiTConfig
    from dit.model.layers import DiTBlock

    block = DiTBlock(DiTConfig(hidden_size=8, num_heads=2))
    variants = gpu_checks._block_variants(block, "eager", "bf16")
    assert set(variants) == {"eager", "compiled", "checkpointed_compiled", "checkpoint_of_compiled"}
    x, c = torch.randn(2, 4, 8), torch.randn(2, 8)
    seen = []
    block.register_forward_hook(lambda m, i, o: seen.append(m.checkpointed))
    variants["checkpointed_compiled"](x, c).sum().backward()
    assert seen and all(seen) and not block.checkpointed  # checkpointed while it ran, as it was after


def test_a_section_that_wrote_nothing_gets_a_timeout_or_failed_record(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "sections").mkdir(parents=True)
    (work / "logs").mkdir()
    (work / "logs" / "bench.log").write_text("step 1\nKilled\n")
    finish = ["--work", str(work), "--out", str(out)]
    gpu_validate.main(["finish", "bench", *finish, "--rc", "124", "--seconds", "195"])
    gpu_validate.main(["finish", "e2e", *finish, "--rc", "139", "--seconds", "3"])
    ok = {"name": "env", "status": "ok", "seconds": 1.0, "figures": {"torch": "x"}}
    (work / "sections" / "env.json").write_text(json.dumps(ok))
    gpu_validate.main(["finish", "env", *finish, "--rc", "0", "--seconds", "1"])
    data = json.loads((out / "gpu_validate.json").read_text())
    records = {r["name"]: r for r in data["sections"]}
    assert [r["name"] for r in data["sections"]] == ["env", "bench", "e2e"] and not data["complete"]
    assert records["bench"]["status"] == "timeout" and "Killed" in records["bench"]["log_tail"]
    assert records["e2e"]["status"] == "failed" and "139" in records["e2e"]["error"]
    assert records["env"] == {
        **ok,
        "process_seconds": 1.0,
    }  # a record the section wrote is kept, its process timed


def test_recompiles_and_graph_breaks_are_captured():
    def f(x):
        print("a graph break")
        return x * 2

    with gpu_checks._Captured() as captured:
        compiled = torch.compile(f, backend="eager")
        compiled(torch.ones(3))
        compiled(torch.ones(3, 4))  # another rank: a recompile
    assert captured.lines["graph_breaks"] and any("rank" in line for line in captured.lines["recompiles"])


def test_a_section_that_raises_records_why(tmp_path):
    assert gpu_validate.main(["sample", "--work", str(tmp_path), "--dry-run", "--fail"]) == 1
    record = json.loads((tmp_path / "sections" / "sample.json").read_text())
    assert record["status"] == "failed" and record["error"] == "RuntimeError: made to fail (--fail)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_the_real_run_refuses_without_a_gpu(tmp_path):
    done = _script("--out", str(tmp_path), timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: no CUDA device") and "--dry-run" in line
    assert not (tmp_path / "gpu_validate.json").exists()


def test_without_out_it_refuses_in_one_line():
    done = _script("--dry-run", timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: no --out DIR") and "$OUT" in line
