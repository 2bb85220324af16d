"""A checkpoint folder from someone else runs no code (issue 41 item 1). Two payloads that create a marker file
when unpickled are planted in a sharded folder whose manifest is rewritten to match: ``os.system`` reached
through a dotted name of DCP's own metadata module (pickle protocol 4 follows it; that module imports ``os``),
and a bytes entry, which DCP's planner reads with ``torch.load(weights_only=False)``. Every face that reads a
folder (sample.py, the export, --init-from, a one-process --resume auto) and the FSDP resume's reader refuse
it in one line, and the marker never appears."""

import hashlib
import json
import os
import pickle
import shutil
import warnings

import pytest
import torch
from test_train_cli import image_folder, run, train_args  # noqa: F401 (image_folder: a fixture)

from dit.checkpoint import dcp_metadata, load_checkpoint, sharded
from dit.io.errors import UserError


class _Payload:
    """A bytes entry that runs ``command`` when it is unpickled."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def dotted_payload(command: str, metadata: bytes) -> bytes:
    """``metadata`` (a protocol-4 pickle) after a call of ``torch.distributed.checkpoint.metadata`` . ``os.system``
    whose result is dropped: the folder still loads where the call is allowed, so nothing looks wrong."""
    call = _short("torch.distributed.checkpoint.metadata") + _short("os.system") + b"\x93" + _short(command)
    return b"\x80\x04" + call + b"\x85R0" + metadata[2:]  # TUPLE1, REDUCE, POP, then the metadata itself


def reseal(folder) -> None:
    """The manifest rewritten to the planted files, as whoever planted them would."""
    manifest = json.loads((folder / sharded.MANIFEST).read_text())
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != "manifest.json"
    }
    (folder / sharded.MANIFEST).write_text(json.dumps({**manifest, "files": files}))


def to_folder(ckpt_file, tensors_of=lambda tensors: tensors) -> None:
    """A one-process run's checkpoint file turned into the sharded folder of the same step (as an FSDP run
    writes it), its tensors passed through ``tensors_of`` first; the file is removed."""
    payload = load_checkpoint(ckpt_file)
    tensors, record = sharded.split(payload)
    final = ckpt_file.with_suffix("")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: one process" note
        sharded.write(sharded.temp_folder(final), tensors_of(tensors))
    sharded.seal(sharded.temp_folder(final), final, payload["step"], record, {})
    ckpt_file.unlink()
    ckpt_file.with_name(ckpt_file.name + ".sha256").unlink()


@pytest.fixture(scope="module")
def trained(image_folder, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("trained")
    done = run(train_args(image_folder, out, 1))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def plant(trained, tmp_path, payload: str):
    """A copy of the trained run whose checkpoint is a sharded folder holding ``payload``; (run, folder, marker)."""
    out, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(trained, out)
    command = f"touch {marker}"
    if payload == "bytes entry":  # the EMA weights replaced by pickled objects: read where tensors are
        to_folder(
            out / "checkpoints" / "0000001.pt", lambda t: {**t, "ema": dict.fromkeys(t["ema"], _Payload(command))}
        )
    else:
        to_folder(out / "checkpoints" / "0000001.pt")
    folder = out / "checkpoints" / "0000001"
    if payload == "dotted name":
        (folder / ".metadata").write_bytes(dotted_payload(command, (folder / ".metadata").read_bytes()))
    reseal(folder)
    return out, folder, marker


def refused(done, folder) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{folder} is not a checkpoint folder dit-ledger wrote" in lines[0], lines[0]


@pytest.mark.parametrize("payload", ("dotted name", "bytes entry"))
def test_a_planted_folder_runs_no_code_in_any_face(image_folder, trained, tmp_path, payload):  # noqa: F811
    out, folder, marker = plant(trained, tmp_path, payload)
    faces = {
        "sample.py": ["sample.py", "--ckpt", str(folder), "--num-sampling-steps", "2", "--class-labels", "0",
                      "--out", str(tmp_path / "grid.png"), "--no-progress"],
        "export": ["-m", "dit.checkpoint", "export", str(folder), str(tmp_path / "export.pt")],
        "--init-from": train_args(image_folder, tmp_path / "tuned", 1, "--init-from", str(folder)),
        "--resume auto": train_args(image_folder, out, 2, "--resume", "auto"),
    }  # fmt: skip
    for face, args in faces.items():
        refused(run(args), folder)
        assert not marker.exists(), f"{face} ran the {payload}'s code"
    assert not (tmp_path / "grid.png").exists() and not (tmp_path / "export.pt").exists()


def test_the_fsdp_resume_reader_refuses_a_bytes_entry_where_it_holds_a_tensor(tmp_path):
    """An FSDP resume reads into its own shards with DCP's default planner, which follows the folder's entry for
    each of its keys: a bytes entry there would be unpickled."""
    folder, marker = tmp_path / "0000001", tmp_path / "MARKER"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded.write(folder, {"model": {"w": _Payload(f"touch {marker}")}})
        with pytest.raises(UserError, match="entry 'model.w' is a BytesStorageMetadata, not a tensor"):
            sharded.read_into(folder, {"model": {"w": torch.zeros(2)}})
    assert not marker.exists()


def test_the_metadata_reader_admits_what_dcp_writes_and_nothing_else(tmp_path):
    """Exact (module, name) pairs: DCP's own metadata loads; a name reached through an allowed module, a
    builtin, an entry under a key we never write, or a shard outside the folder is refused."""
    folder = tmp_path / "0000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = {
            "model": {"w": torch.ones(2, dtype=torch.bfloat16)},
            "optimizer": {"state": {"w": {"step": torch.tensor(1.0)}}},
        }
        sharded.write(folder, tensors)
    path = folder / ".metadata"
    good = path.read_bytes()
    escaping = pickle.loads(good)
    for info in escaping.storage_data.values():
        info.relative_path = "../other/__0_0.distcp"
    assert sorted(dcp_metadata.read(path, sharded.TENSORS).state_dict_metadata) == [
        "model.w",
        "optimizer.state.w.step",
    ]
    with pytest.raises(UserError, match="entry 'model.w' is none of the model"):
        dcp_metadata.read(path, ("ema",))
    for bad, why in (
        (dotted_payload("true", good), "names torch.distributed.checkpoint.metadata.os.system"),
        (
            b"\x80\x04" + _short("builtins") + _short("eval") + b"\x93" + _short("1") + b"\x85R.",
            "names builtins.eval",
        ),
        (pickle.dumps(escaping), "stored in '../other/__0_0.distcp', not in a shard file of the folder"),
    ):
        path.write_bytes(bad)
        with pytest.raises(UserError, match=why):
            dcp_metadata.read(path, sharded.TENSORS)
