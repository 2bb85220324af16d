"""Paths read from files stay inside their folders, and no face writes over what it reads (docs/reliability.md,
rows 46-48): a planted or edited manifest, record or link is one ``error:`` line, with nothing outside read,
moved or deleted; every command line parses through a Face, which checks its outputs against its inputs."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FACE_MODULES, ROOT, faces, run_face
from test_train import Pixels, tiny_config

from dit.checkpoint import list_checkpoints, load_checkpoint
from dit.checkpoint.format import atomic_torch_save
from dit.data.reader import LatentStoreDataset
from dit.data.store import MANIFEST, manifest_sha256, shard_file, write_moments_store
from dit.io.cli import run_cli
from dit.io.errors import UserError
from dit.train import train


def _one_line(code: int, err: str) -> str:
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.fixture
def store(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)
    moments = torch.randn(16, 2, 2, 4, 4, 4, generator=g).abs() * 0.1
    write_moments_store(str(tmp_path / "store"), moments, torch.arange(16) % 2, num_classes=2, shard_size=8)
    return tmp_path / "store"


def _name_shard(store: Path, index: int, name: str) -> None:
    """The manifest's shard ``index`` renamed to ``name``, its checksum made again, as a planted file would."""
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][index]["file"] = name
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    (store / MANIFEST).write_text(json.dumps(manifest))


def _other_shard(store: Path) -> Path:
    """A shard of another store beside this one, with other labels: the file a planted manifest names."""
    other = store.parent / "other"
    g = torch.Generator().manual_seed(1)
    moments = torch.randn(16, 2, 2, 4, 4, 4, generator=g).abs() * 0.1
    write_moments_store(str(other), moments, torch.ones(16, dtype=torch.long), num_classes=2, shard_size=8)
    return other / shard_file(0)


# ---- 46. a path out of a store's manifest, or a link out of the store ------------------------------------


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_a_manifest_naming_a_shard_outside_its_store_is_one_line_everywhere(how, store, tmp_path, capsys):
    """The store trained silently on the other store's shard (with its labels), and --verify said sha256 OK."""
    from dit.train import resolve

    outside = _other_shard(store)
    entry = {"relative": f"../other/{shard_file(0)}", "absolute": str(outside)}[how]
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][0].update(sha256=json.loads((outside.parent / MANIFEST).read_text())["shards"][0]["sha256"])
    (store / MANIFEST).write_text(json.dumps(manifest))
    _name_shard(store, 0, entry)
    run = tmp_path / "run"
    code = run_cli(lambda argv: resolve(argv) and 0, ["--feature-path", str(store), "--results-dir", str(run)])
    err = _one_line(code, capsys.readouterr().err)
    assert f"{store / MANIFEST}: shard 0's file {entry!r}" in err and f"inside {store}" in err, err
    code, out, err = run_face("extract_features.py", ["--feature-path", str(store), "--verify"], capsys)
    assert "sha256 OK" not in out and f"shard 0's file {entry!r}" in _one_line(code, err), (out, err)
    with pytest.raises(UserError, match="is not a name inside"):
        LatentStoreDataset(str(store))
    assert not run.exists()


def test_verify_hashes_the_file_the_manifest_names(store, capsys):
    """--verify hashed shard-00000 whatever the manifest named: a damaged file it names passed."""
    named = store / "renamed.safetensors"
    data = bytearray((store / shard_file(0)).read_bytes())
    data[-7] ^= 0x40
    named.write_bytes(bytes(data))
    _name_shard(store, 0, named.name)
    code, out, err = run_face("extract_features.py", ["--feature-path", str(store), "--verify"], capsys)
    assert "sha256 OK" not in out and "renamed.safetensors fails its sha256 check" in _one_line(code, err), err


def test_a_shard_linked_out_of_the_store_is_refused(store, capsys):
    outside = _other_shard(store)
    shutil.copyfile(store / shard_file(1), outside.parent / "copy.safetensors")  # the same bytes, elsewhere
    (store / shard_file(1)).unlink()
    (store / shard_file(1)).symlink_to(outside.parent / "copy.safetensors")
    with pytest.raises(UserError, match=rf"shard 1's file '{shard_file(1)}' is not a name inside .*\(to "):
        LatentStoreDataset(str(store))
    code, out, err = run_face("extract_features.py", ["--feature-path", str(store), "--verify"], capsys)
    assert "sha256 OK" not in out and "is not a name inside" in _one_line(code, err), err


# ---- 47. names in checkpoint records: a branch, the parent, a sharded folder's files ------------------------


@pytest.mark.parametrize("branch", ["../../escaped", "sub/dir", "{tmp}/escaped"])
def test_a_branch_name_that_is_a_path_moves_nothing(branch, tmp_path):
    """A rollback moves the checkpoints off its line to abandoned/BRANCH/: a planted branch ``../../x`` (or an
    absolute path) moved them out of the checkpoint folder."""
    branch = branch.format(tmp=tmp_path)
    train(tiny_config(tmp_path, max_steps=4, ckpt_every=2, keep_last=0), Pixels())
    folder = tmp_path / "run" / "checkpoints"
    ckpt = load_checkpoint(folder / "0000004.pt")
    ckpt["lineage"]["branch"] = branch
    atomic_torch_save(ckpt, folder / "0000004.pt")  # its checksum made again
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    again = tiny_config(tmp_path, max_steps=4, ckpt_every=2, keep_last=0, lr=5e-4, allow_changes=["lr"],
                        resume=str(folder / "0000002.pt"))  # fmt: skip
    with pytest.raises(UserError, match=rf"0000004\.pt: branch '{re.escape(branch)}' is not a name inside"):
        train(again, Pixels())
    assert [s for s, _ in list_checkpoints(folder)] == [2, 4] and not (tmp_path / "escaped").exists()
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert not any("abandoned" in p.parts for p in after) and set(before) <= set(after)


def test_a_branch_record_whose_parent_lies_outside_is_not_followed(tmp_path):
    from dit.checkpoint.lineage import HEAD, follow

    train(tiny_config(tmp_path, max_steps=2, ckpt_every=2), Pixels())
    folder = tmp_path / "run" / "checkpoints"
    shutil.copyfile(folder / "0000002.pt", tmp_path / "planted.pt")
    shutil.copyfile(folder / "0000002.pt.sha256", tmp_path / "planted.pt.sha256")
    head = {"branch": "feedbeef", "forks": {}, "parent": {"file": "planted.pt", "path": "../../planted.pt",
                                                           "step": 2, "sha256": None, "branch": ""}}  # fmt: skip
    (folder / HEAD).write_text(json.dumps(head))
    with pytest.raises(UserError, match=r"branch\.json: parent path '\.\./\.\./planted\.pt' is not a name inside"):
        follow(folder)


def test_a_sharded_folder_naming_files_outside_is_refused(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    from dit.checkpoint import sharded

    folder = tmp_path / "0000001"
    dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=folder)
    torch.save({"optimizer": {"param_groups": []}, "step": 1}, folder / sharded.RECORD)
    # the manifest lists a file out of the folder (its digest right): it was hashed there
    (tmp_path / "elsewhere").write_bytes(b"x")
    digest = sharded.sha256_file(tmp_path / "elsewhere")
    (folder / sharded.MANIFEST).write_text(
        json.dumps({"format": sharded.FOLDER_FORMAT, "files": {"../elsewhere": digest}})
    )
    with pytest.raises(UserError, match=r"manifest\.json: file '\.\./elsewhere' is not a name inside"):
        sharded.verify(folder)
    # DCP's own metadata names its shard files: one moved out of the folder was read from there
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file, written just now
    (shard,) = {info.relative_path for info in metadata.storage_data.values()}
    os.replace(folder / shard, tmp_path / shard)
    for info in metadata.storage_data.values():
        info.relative_path = f"../{shard}"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        UserError, match=rf"stored in '\.\./{re.escape(shard)}', not in a shard file of the folder"
    ):
        sharded.read(folder)


@pytest.mark.parametrize("sampler", ["../../escaped", "{tmp}/escaped"])
def test_a_study_row_naming_features_outside_its_folder_is_refused(sampler, tmp_path):
    """A study's rows name each setting's features file: a row made into a path opened a file outside."""
    from helpers import face

    sampler = sampler.format(tmp=tmp_path)
    study = tmp_path / "study.json"
    row = {"sampler": sampler, "steps": 5, "guidance_scale": 1.0, "interval": "none", "fid": 1.0, "fd_judge": 1.0,
           "intervals": {}, "sampling_tflop_per_1000": 1.0}  # fmt: skip
    study.write_text(json.dumps({"ckpt_sha256": "0", "num_samples": 2, "seed": 0, "feature_networks": [],
                                 "rows": [row]}))  # fmt: skip
    with pytest.raises(UserError, match=rf"{re.escape(str(study))}: row '.*escaped.*' is not a name inside"):
        face("studies/sampling_verdicts.py").load((str(study),), {"fid": (np.zeros(2), np.eye(2))})


# ---- 48. a face that writes over or inside what it reads --------------------------------------------------


def test_the_export_face_refuses_to_write_inside_the_folder_it_reads(tmp_path, capsys):
    """``python -m dit.checkpoint export FOLDER FOLDER/record.pt`` exited 0 and broke the checkpoint it read."""
    from dit.checkpoint.__main__ import main

    folder = tmp_path / "0000002"
    folder.mkdir()
    (folder / "record.pt").write_bytes(b"the record")
    for out in (folder / "record.pt", folder / "new.pt"):
        err = _one_line(run_cli(main, ["export", str(folder), str(out)]), capsys.readouterr().err)
        assert f"{out} is inside --folder {folder}" in err or "which this command reads" in err, err
    assert (
        sorted(p.name for p in folder.iterdir()) == ["record.pt"]
        and (folder / "record.pt").read_bytes() == b"the record"
    )


WRITES = re.compile(
    r"atomic_write|write_text|write_bytes|torch\.save|savefig|save_pretrained|open\([^)]*[\"'][wa]"
)
# Command lines with no Face: what each reads and writes (nothing a user names is written).
NO_FACE = {
    "scripts/installed.py": "takes install-set names and prints what is missing; writes nothing",
    "studies/vae_precision.py": "measures a VAE built in memory and prints the figures; writes nothing",
}


def _entry_points() -> list[str]:
    """Every command line of the repository: a top-level script, a script under scripts/ or studies/, a package's
    ``__main__.py``, any module with a ``__main__`` guard."""
    found = []
    folders = ("scripts/*.py", "studies/*.py", "dit/**/*.py")
    for path in sorted({*ROOT.glob("*.py"), *(p for folder in folders for p in ROOT.glob(folder))}):
        if path.name == "__main__.py" or re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M):
            found.append(str(path.relative_to(ROOT)))
    return found


def _parses_with_argparse(text: str) -> bool:
    calls = (n.func for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call))
    return any(getattr(f, "attr", getattr(f, "id", None)) in ("ArgumentParser", "Parser") for f in calls)


@pytest.mark.parametrize("path", _entry_points())
def test_every_command_line_parses_through_a_face_that_declares_its_outputs(path):
    """Face.parse checks every declared output against every declared input before any work (row 34), so a
    command line that parses otherwise skips it: export did. Each entry point is a face of the sweep (in
    helpers.FACE_MODULES, so the sweep's output tests run on it) or writes nothing, and none builds its own
    argparse parser."""
    text = (ROOT / path).read_text()
    package = str(Path(path).with_name("__init__.py"))
    modules = [p for p in (path, package) if p in FACE_MODULES.values()]
    if not modules and Path(path).name == "__main__.py":  # a package's body in a module beside it
        modules = [p for p in FACE_MODULES.values() if Path(p).parent == Path(path).parent]
    if path in NO_FACE:
        assert not WRITES.search(text), f"{path} writes: give it a Face with outputs"
        return
    assert modules, f"{path} is a command line outside helpers.FACE_MODULES: give it a Face, list it there"
    assert not _parses_with_argparse((ROOT / modules[0]).read_text()), f"{path} parses without its Face"
    names = [n for n, m in FACE_MODULES.items() if m == modules[0]]
    declared = [f.outputs for n in names for f in [faces()[n], *faces()[n].commands.values()]]
    if path == "dit/eval/__main__.py":
        declared.append(faces()["dit.eval ref"].outputs)
    assert any(declared) or not WRITES.search(text), f"{path} writes but its Face declares no outputs"
