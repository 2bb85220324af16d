"""scripts/gpu_validate.sh and the cuda marker (tests/gpu.py): ``pytest -m cuda`` lists every check the run had
before it became tests, the dry run on the CPU passes them and leaves what the device machine returns (at most 8
files, two folders deep, 16 MiB each), a test over its limit fails and the next one runs, one stuck past it ends
the process with its traceback, the GPU run's limits fit its lease, and without a GPU (or --out) the run refuses."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_gpu_device
import test_gpu_train
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "scripts" / "gpu_validate.sh"

# The checks of gpu_validate before they were tests, by its former section, and the tests that make them now
# (a new marked test needs no entry); its bench and sample sections are the runner's benchmark rows.
FORMER_CHECKS = {
    "env": ["test_gpu_device.py::test_env_and_datasheet_peak"],
    "flags": ["test_gpu_device.py::test_precision_flags_read_and_compiled_matmul"],
    "numerics": ["test_gpu_device.py::test_block_numerics_compiled_and_checkpointed[fp32]",
                 "test_gpu_device.py::test_block_numerics_compiled_and_checkpointed[bf16]",
                 "test_gpu_device.py::test_sdpa_backends_against_float64"],
    "sync": ["test_gpu_device.py::test_no_host_sync_in_train_steps",
             "test_gpu_device.py::test_a_nan_batch_changes_nothing"],
    "parallel": ["test_gpu_train.py::test_ddp_over_one_rank_is_one_process_bit_for_bit",
                 "test_gpu_train.py::test_fsdp2_is_close_to_one_process",
                 "test_gpu_train.py::test_a_dcp_save_of_fsdp2_resumes_bit_for_bit"],
    "e2e": ["test_gpu_train.py::test_train_py_resumed_from_a_save_is_bit_for_bit"],
}  # fmt: skip
CHECKS = sorted(f"tests/{t}" for tests in FORMER_CHECKS.values() for t in tests)
RETURN_FILES, RETURN_DEPTH, RETURN_BYTES = 8, 2, 16 * 2**20  # what the device machine brings back from $OUT


def _script(*args, env_extra=None, **kw):
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", str(RUNNER), *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw)


def _pytest(*args, cwd=ROOT, env_extra=None, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, **kw)  # fmt: skip


def test_collect_only_lists_every_former_check_and_the_runner_runs_them():
    done = _pytest("-m", "cuda", "--collect-only", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    collected = sorted(line for line in done.stdout.splitlines() if "::" in line)
    assert set(CHECKS) <= set(collected), sorted(set(CHECKS) - set(collected))
    runs = RUNNER.read_text()
    assert all(t.split("::")[0] in runs for t in collected)


def _marked():
    """(test, its cuda marker, how many cases its parameters make) of every marked test."""
    for module in (test_gpu_device, test_gpu_train):
        for name, fn in vars(module).items():
            marks = {m.name: m for m in getattr(fn, "pytestmark", [])}
            if name.startswith("test_") and "cuda" in marks:
                cases = len(marks["parametrize"].args[1]) if "parametrize" in marks else 1
                yield name, marks["cuda"], cases


def test_the_gpu_run_fits_its_lease_with_a_rerun_to_spare():
    """The tests' GPU limits and pytest's start fit pytest's limit; it and the benchmark rows' limits, with the
    seconds each may take to die, stay under the 420 s that leave a rerun inside the device's 10-minute command
    limit. Every marked test has both limits."""
    text = RUNNER.read_text()
    (line,) = [x.split() for x in text.splitlines() if x.strip().startswith("pytest_limit=") and "DiT-XL" in x]
    pytest_limit = int(line[0].split("=")[1])
    marked = list(_marked())
    assert {n for n, _, _ in marked} >= {c.split("::")[1].split("[")[0] for c in CHECKS}
    assert all({"seconds", "dry_seconds"} <= set(m.kwargs) for _, m, _ in marked)
    start = 25  # the interpreter, torch, the package and the collection
    assert sum(m.kwargs["seconds"] * n for _, m, n in marked) + start <= pytest_limit
    rows = [x.split() for x in text.splitlines() if x.startswith("row ")]
    assert [r[1].split("_")[0] for r in rows] == ["train", "train", "train", "sample"]
    assert pytest_limit + 5 + sum(int(r[2]) + 2 for r in rows) <= 400


@pytest.mark.slow
def test_dry_run_passes_every_check_and_returns_what_the_device_returns(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    done = _script("--dry-run", "--out", str(out), timeout=7200, env_extra={"TMPDIR": str(scratch)})
    log = (out / "gpu_validate.log").read_text()
    assert done.returncode == 0, log[-5000:]
    assert list(scratch.iterdir()) == []  # the scratch folder is gone
    files = [p for p in out.rglob("*") if not p.is_dir()]
    assert 0 < len(files) <= RETURN_FILES, files
    for p in files:
        assert p.is_file() and not p.is_symlink() and len(p.relative_to(out).parts) - 1 <= RETURN_DEPTH, p
        assert p.stat().st_size <= RETURN_BYTES, (p, p.stat().st_size)
    assert sorted(p.name for p in files) == sorted(
        ["gpu_validate.json", "gpu_validate.log", "bench_train_b2_eager.json", "bench_train_b2_compiled.json",
         "bench_train_b4_compiled_checkpointed.json", "bench_sample.json"]
    )  # fmt: skip
    data = json.loads((out / "gpu_validate.json").read_text())
    assert data["dry_run"] and data["complete"]
    tests = {t["test"]: t for t in data["tests"]}
    assert set(CHECKS) <= set(tests)
    outcomes = {name.split("::")[1]: t["outcome"] for name, t in tests.items()}
    assert outcomes.pop("test_no_host_sync_in_train_steps") == "skipped"  # CUDA-only, with its reason
    assert set(outcomes.values()) == {"passed"}, outcomes
    figures = {name.split("::")[1]: t.get("figures", {}) for name, t in tests.items()}
    assert figures["test_env_and_datasheet_peak"]["torch"] == torch.__version__
    assert figures["test_fsdp2_is_close_to_one_process"]["backend"] == "gloo"
    assert figures["test_train_py_resumed_from_a_save_is_bit_for_bit"]["estimate_gib"] > 0
    for name in ("train_b2_eager", "train_b2_compiled", "train_b4_compiled_checkpointed", "sample"):
        bench = json.loads((out / f"bench_{name}.json").read_text())
        assert bench["complete"] and all(r["images_per_sec"] > 0 for r in bench["rows"]), bench


LIMITS = """
    import signal, time
    import pytest

    @pytest.mark.cuda(seconds=1, dry_seconds=1)
    def test_passes():
        pass

    @pytest.mark.cuda(seconds=1, dry_seconds=1)
    def test_sleeps():
        time.sleep(120)

    @pytest.mark.cuda(seconds=1, dry_seconds=1)
    def test_after_it():
        pass
"""
STUCK = """
    @pytest.mark.cuda(seconds=1, dry_seconds=1)
    def test_stuck_where_no_signal_reaches():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(120)
"""


def _limits(tmp_path, text: str, dry: bool = True):
    (tmp_path / "test_limits.py").write_text(textwrap.dedent(text))
    results = tmp_path / "results.json"
    env = {"DIT_GPU_RESULTS": str(results), "DIT_GPU_DRY_RUN": "1" if dry else "0"}
    done = _pytest("-p", "gpu", "--capture=sys", "-rs", "test_limits.py", cwd=tmp_path, env_extra=env, timeout=300)
    return done, json.loads(results.read_text()) if results.exists() else None


def test_a_test_over_its_limit_fails_and_the_next_one_runs(tmp_path):
    done, data = _limits(tmp_path, LIMITS)
    assert done.returncode == 1 and data["complete"], done.stdout
    outcomes = {t["test"].split("::")[1]: t["outcome"] for t in data["tests"]}
    assert outcomes == {"test_passes": "passed", "test_sleeps": "failed", "test_after_it": "passed"}
    (sleeps,) = [t for t in data["tests"] if t["outcome"] == "failed"]
    assert "over its 1 s limit" in sleeps["error"] and sleeps["seconds"] < 60


def test_a_test_stuck_past_its_limit_ends_the_run_with_its_traceback(tmp_path):
    done, data = _limits(tmp_path, LIMITS + STUCK)
    assert done.returncode != 0 and not data["complete"]
    assert len(data["tests"]) == 3  # what finished before it is kept
    assert "Timeout" in done.stderr and "test_stuck_where_no_signal_reaches" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without a GPU")
def test_without_a_device_the_marked_tests_skip(tmp_path):
    done, data = _limits(tmp_path, LIMITS, dry=False)
    assert done.returncode == 0 and "needs a CUDA device" in done.stdout
    assert {t["outcome"] for t in data["tests"]} == {"skipped"}


def test_the_block_variants_run_what_the_trainer_runs():
    """The numerics have the trainer's block (checkpointed inside, compiled) beside an outer checkpoint of a
    compiled block, and the block is checkpointed while the trainer's variant runs, not after."""
    from dit.model.config import DiTConfig
    from dit.model.layers import DiTBlock

    block = DiTBlock(DiTConfig(hidden_size=8, num_heads=2))
    variants = test_gpu_device.block_variants(block, "eager", "bf16")
    assert set(variants) == {"eager", "compiled", "checkpointed_compiled", "checkpoint_of_compiled"}
    x, c = torch.randn(2, 4, 8), torch.randn(2, 8)
    seen = []
    block.register_forward_hook(lambda m, i, o: seen.append(m.checkpointed))
    variants["checkpointed_compiled"](x, c).sum().backward()
    assert seen and all(seen) and not block.checkpointed


def test_recompiles_and_graph_breaks_are_captured():
    def f(x):
        print("a graph break")
        return x * 2

    with test_gpu_device.Captured() as captured:
        compiled = torch.compile(f, backend="eager")
        compiled(torch.ones(3))
        compiled(torch.ones(3, 4))  # another rank: a recompile
    assert captured.lines["graph_breaks"] and any("rank" in line for line in captured.lines["recompiles"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_the_real_run_refuses_without_a_gpu(tmp_path):
    done = _script("--out", str(tmp_path), timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: no CUDA device") and "--dry-run" in line
    assert list(tmp_path.iterdir()) == []


def test_without_out_it_refuses_in_one_line():
    done = _script("--dry-run", timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: no --out DIR") and "$OUT" in line
