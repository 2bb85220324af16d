"""The ledger's sinks: every chosen sink gets the records the run keeps; W&B offline, resumed, and missing."""

import errno
import json
import sys
from pathlib import Path

import pytest
from helpers import make_image_folder, run_face
from test_train import Pixels, tiny_config

from dit.io.errors import UserError
from dit.train import train
from dit.train.ledger import LedgerSection
from dit.train.sinks import Sink, Sinks


class Probe(Sink):
    """A sink that keeps what it is given, and refuses writes once ``full``."""

    full = False

    def __init__(self, section, out, record, start):
        self.path, self.got = out / "probe", [("record", record)]

    def scalars(self, record, step):
        self.got.append(("scalars", record, step))

    def image(self, tag, image_chw, step):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.got.append(("image", tag, step))


def test_a_chosen_sink_gets_the_records_metrics_jsonl_keeps_and_a_refused_write_is_one_line(tmp_path):
    sinks = Sinks(LedgerSection(), tmp_path, {"ledger": {"sinks": ["probe"]}}, [Probe])
    sinks.log({"kind": "eval", "step": 3, "fid": 1.5, "in_warmup": False}, console_keys=("step", "fid"))
    sinks.image("samples/ema", None, 3)
    sinks.info("a line")  # text: Probe keeps the Sink default, which does nothing
    (probe,) = (s for s in sinks.sinks if isinstance(s, Probe))
    (kept,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert probe.got == [("record", {"ledger": {"sinks": ["probe"]}}), ("scalars", kept, 3),
                         ("image", "samples/ema", 3)]  # fmt: skip
    assert f"{kept['time']} eval: step=3 fid=1.5" in (tmp_path / "log.txt").read_text()  # one time for both
    probe.full = True
    with pytest.raises(UserError, match=f"cannot write {tmp_path / 'probe'}: No space left on device. Free space"):
        sinks.image("samples/ema", None, 4)
    sinks.close()


def test_a_sink_is_one_file_found_by_its_name_with_its_options(tmp_path, monkeypatch):
    import dit.train
    from dit.train.ledger import _sink_modules
    from dit.train.sinks_wandb import WandB

    (tmp_path / "sinks_probe.py").write_text(
        "from dataclasses import dataclass\n"
        "from dit.io.config import Section, option\n"
        "from dit.train.sinks import Sink\n\n"
        "@dataclass(frozen=True)\n"
        "class ProbeOptions(Section):\n"
        "    probe_level: int = option(1, 'how loud', ge=0)\n\n"
        "class Probe(Sink):\n"
        "    options = ProbeOptions\n\n"
        "SINK = Probe\n"
    )
    monkeypatch.setattr(dit.train, "__path__", [*dit.train.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "dit.train.sinks_probe", raising=False)
    found = _sink_modules()
    assert found["wandb"] is WandB and found["probe"].__name__ == "Probe"
    assert found["probe"].options.names() == ("probe_level",)
    sys.modules.pop("dit.train.sinks_probe", None)
    # W&B's options are the ledger section's, after its own: the flags and record keys users know
    assert LedgerSection.names()[-3:] == ("sinks", "wandb_project", "wandb_entity")


def wandb_segment(run_file) -> tuple[dict | None, list[dict]]:
    """An offline W&B run file's rewind point (the ``branch_point`` its run record holds: run id and step; None
    without one) and its history rows. The file is a LevelDB-style log (a 7-byte file header, 32 KiB blocks, each
    record a 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last) and its bytes), each one
    W&B ``Record``; read here because wandb no longer ships a Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, part, rows, branch = run_file.read_bytes(), 7, 32768, b"", [], None
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
            elif record.WhichOneof("record_type") == "run" and record.run.HasField("branch_point"):
                point = record.run.branch_point
                branch = {"run": point.run, "step": point.value, "metric": point.metric}
    return branch, rows


def wandb_segments(run: Path) -> list[tuple[dict | None, list[dict]]]:
    """Each segment of the results folder's one W&B run, found by the run id it keeps (not by its folder's name:
    two segments started in one second get a ``-1`` suffix), in the order of their first step. W&B's service
    writes the files after ``run.finish`` returns: its teardown waits for them."""
    import wandb

    wandb.teardown()
    run_id = (run / "wandb" / "run-id").read_text()
    files = list((run / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
    assert files and all(f"-{run_id}" in f.parent.name for f in files)
    return sorted(map(wandb_segment, files), key=lambda seg: seg[1][0]["_step"] if seg[1] else -1)


def test_wandb_offline_keeps_the_step_metrics_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR"):  # nothing outside the test's folder
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    common = dict(sinks=("tensorboard", "wandb"), log_every=2, ckpt_every=2, mfu_warmup_steps=0)
    train(tiny_config(tmp_path, max_steps=4, sample_every=4, **common), Pixels())
    train(tiny_config(tmp_path, max_steps=6, resume="auto", **common), Pixels())
    run_id = (run / "wandb" / "run-id").read_text()
    (first, rows), (resumed, more) = wandb_segments(run)  # one W&B run, resumed
    assert first is None and resumed == {"run": run_id, "step": 4, "metric": "_step"}  # W&B's rewind to step 4
    logged = rows + more
    kept = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["_step"] for row in logged] == [r["step"] for r in kept] == [2, 4, 6]
    for row, record in zip(logged, kept):
        assert row["train/loss"] == pytest.approx(record["loss"], rel=1e-12)
        assert row["train/mfu"] == pytest.approx(record["mfu"], rel=1e-12)
    assert logged[1]["samples/ema/_type"] == "image-file"  # the grid, in the row of its step
    assert (run / "tensorboard").is_dir()  # and TensorBoard beside it


def test_wandb_after_a_rollback_rewinds_the_run_to_the_resumed_step(tmp_path, monkeypatch):
    """A resume from step 2 of a run W&B already has to step 6 (a rollback; a kill past the last checkpoint is
    the same): the resumed steps 4 and 6 are logged after a rewind to step 2, not dropped as steps W&B has."""
    pytest.importorskip("wandb")
    for name in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR"):
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    common = dict(sinks=("wandb",), log_every=2, ckpt_every=2, mfu_warmup_steps=0)
    train(tiny_config(tmp_path, max_steps=6, **common), Pixels())
    back = run / "checkpoints" / "0000002.pt"
    train(tiny_config(tmp_path, max_steps=6, resume=str(back), **common), Pixels())
    run_id = (run / "wandb" / "run-id").read_text()
    (first, rows), (rewound, again) = wandb_segments(run)
    assert first is None and [row["_step"] for row in rows] == [2, 4, 6]
    assert rewound == {"run": run_id, "step": 2, "metric": "_step"}
    assert [row["_step"] for row in again] == [4, 6]


def test_sinks_wandb_without_the_extra_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # "import wandb" raises ImportError
    images = make_image_folder(tmp_path / "images", {"a": 2, "b": 2})
    argv = ["--data-path", images, "--vae", "none", "--depth", "1", "--hidden-size", "32", "--num-heads", "2",
            "--image-size", "8", "--num-classes", "3", "--global-batch-size", "2", "--max-steps", "1",
            "--precision", "fp32", "--num-workers", "0", "--peak-tflops", "0.05", "--device", "cpu",
            "--results-dir", str(tmp_path / "run"), "--sinks", "wandb"]  # fmt: skip
    code, _, err = run_face("train.py", argv, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "--sinks wandb needs wandb" in errors[0] and "pip install 'dit-ledger[wandb]'" in errors[0]
    assert not list((tmp_path / "run" / "checkpoints").glob("*.pt"))
