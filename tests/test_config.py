"""Configuration sections: checked once where they are built, frozen after, small, saved with the run, and
read back by a resume that is given nothing else."""

from __future__ import annotations

import collections
import dataclasses
import importlib
import pkgutil
import shutil
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dit
from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.io.config import Section
from dit.io.errors import UserError
from dit.train import TRAIN_FACE, TrainConfig, resolve, train

DATA = Path(__file__).resolve().parent / "data"


def all_sections() -> list[type]:
    for info in pkgutil.walk_packages(dit.__path__, "dit."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found, todo = set(), [Section]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return sorted(found, key=lambda c: c.__qualname__)


def test_sections_are_small_and_frozen():
    sections = all_sections()
    assert len(sections) >= 10
    for cls in sections:
        assert len(dataclasses.fields(cls)) <= 20, f"{cls.__qualname__} has {len(dataclasses.fields(cls))} fields"
        assert cls.__dataclass_params__.frozen, cls
    assert len(dataclasses.fields(TrainConfig)) <= 20
    cfg = TrainConfig.of(max_steps=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = None


@pytest.mark.parametrize(
    "text,key",
    [("max_steps: 2.5\n", "max_steps"), ("compile: maybe\n", "compile"), ("lr: .nan\n", "lr"),
     ("num_classes: ten\n", "num_classes"), ("optim:\n  lr: -1\n", "lr"), ("eval:\n  every: 1.5\n", "eval_every")],
)  # fmt: skip
def test_a_yaml_value_of_the_wrong_type_names_its_key(tmp_path, text, key):
    """YAML max_steps: 2.5 once ran to step 3 and compile: maybe was taken as on: now one line naming the key."""
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    with pytest.raises(UserError) as e:
        resolve(["--config", str(preset)])
    assert f"{preset}: {key}" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--lr", "nan"], "--lr"),
        (["--ema-decay", "inf"], "--ema-decay"),
        (["--max-steps", "0"], "--max-steps"),
        (["--eval-every", "5"], "--eval-every"),
    ],
)
def test_a_bad_flag_is_one_error_naming_the_flag(argv, flag):
    with pytest.raises(UserError) as e:
        resolve(argv)
    assert str(e.value).startswith(flag) or flag in str(e.value), str(e.value)


def test_yaml_presets_fill_the_same_sections_as_flags(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: DiT-B/4\nlr: 3.0e-4\neval_every: 0\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("model:\n  model: DiT-B/4\noptim:\n  lr: 3e-4\n")  # PyYAML reads 3e-4 as a string
    a, b = resolve(["--config", str(flat)]), resolve(["--config", str(nested)])
    c = resolve(["--model", "DiT-B/4", "--lr", "3e-4"])
    assert a == b == c and a.optim.lr == 3e-4 and a.model.model == "DiT-B/4"
    assert resolve(["--config", str(flat), "--lr", "1e-3"]).optim.lr == 1e-3  # flags override it


def test_the_record_round_trips_through_config_yaml(tmp_path):
    import yaml

    cfg = TrainConfig.of(max_steps=7, lr=2e-4, eval_every=0, allow_changes=["lr"], resume="auto")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.record()))
    assert resolve(["--config", str(path)]) == cfg


class Pixels(torch.utils.data.Dataset):
    """The data set tests/data/checkpoint_v1/make.py trained on."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, 8, 8, generator=g) * 2 - 1, i % 2


# |reached - stored| at step 2, largest over the weights, for tests/data/checkpoint_v1 on an AMD EPYC (Zen 4:
# AVX-512, AVX512-BF16) under the kernel sets torch and oneDNN pick on other CPUs (1 thread, as the suite runs):
# ATen's AVX-512 and AVX2 kernels (ATEN_CPU_CAPABILITY=avx512, avx2) reach it bit for bit; its unvectorised ones
# (=default) differ by 6.1e-7 in the model, 2.2e-12 in the EMA; oneDNN capped at SSE4.1 (ONEDNN_MAX_CPU_ISA=SSE41)
# by 4.8e-8 and 4.8e-12; 2 threads by 2.2e-8. A step moves the model by up to 1e-3 (the lr), the EMA by 2e-7. The
# bounds are about 10x the largest difference measured, while lr 1 % off (1e-5), EMA decay 0.99999 (1.8e-7 in the
# EMA), a step more or lost optimizer state (1e-3) land far outside them; V1_RTOL (4 float32 ulps) lets a large
# EMA weight round the other way.
V1_ATOL, V1_RTOL = {"model": 6e-6, "ema": 5e-11}, 4.8e-7


def test_a_checkpoint_of_the_flat_format_resumes_to_the_weights_it_reached(tmp_path):
    """tests/data/checkpoint_v1 was written before the sections (a flat run config): it resumes, from its own
    record alone, to the weights the old code reached at its next step (stored, so to within what another CPU's
    kernels change), and bit for bit to where the same state under today's record resumes in this run."""

    def resume(run: Path, ckpt: dict | None = None) -> dict:
        (run / "checkpoints").mkdir(parents=True)
        if ckpt is None:
            shutil.copy(DATA / "checkpoint_v1" / "0000001.pt", run / "checkpoints")
        else:
            torch.save(ckpt, run / "checkpoints" / "0000001.pt")
        cfg = resolve(["--results-dir", str(run), "--resume", "auto", "--max-steps", "2", "--device", "cpu"])
        assert (cfg.model.hidden_size, cfg.model.image_size, cfg.data.vae, cfg.optim.lr) == (16, 8, "none", 1e-3)
        train(cfg, Pixels())
        return load_checkpoint(latest_checkpoint(run / "checkpoints"))

    reached = resume(tmp_path / "flat")
    assert isinstance(reached["config"]["model"], dict), "written again in the sections' layout"
    nested = torch.load(DATA / "checkpoint_v1" / "0000001.pt", weights_only=True)
    nested["config"] = reached["config"]  # the same step-1 state under the record the resumed run wrote
    again = resume(tmp_path / "nested", nested)
    expected = load_file(DATA / "checkpoint_v1" / "step2_weights.safetensors")
    for kind in ("model", "ema"):
        for name, tensor in reached[kind].items():
            stored = expected[f"{kind}.{name}"]
            off = (tensor - stored).abs()
            assert (off <= V1_ATOL[kind] + V1_RTOL * stored.abs()).all(), f"{kind}.{name} off by {off.max():.3g}"
            assert torch.equal(tensor, again[kind][name]), f"{kind}.{name}"


def test_a_resumed_run_takes_its_settings_from_the_record_and_names_a_changed_one(tmp_path, capsys):
    from test_train import Pixels as Digits
    from test_train import tiny_config

    cfg = tiny_config(tmp_path, max_steps=2, lr=5e-4, log_every=1)
    train(cfg, Digits())
    resumed = resolve(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--max-steps", "3"])
    assert resumed.replace(max_steps=2, resume=None) == cfg, "every option but the given ones from the record"
    capsys.readouterr()
    train(resumed, Digits())
    assert "changed on this resume: --max-steps 3 (recorded 2)" in capsys.readouterr().err
    with pytest.raises(
        UserError, match="lr: 0.0005 -> 0.001"
    ):  # a recipe field is refused without --allow-changes
        train(
            resolve(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--lr", "1e-3"]),
            Digits(),
        )


def test_the_trainer_flags_are_the_sections_fields():
    """One flag per field, and no field spelled twice across sections."""
    flags = {a.dest for a in TRAIN_FACE.parser()._actions} - {"help", "config"}
    assert flags == set(TRAIN_FACE.fields)
    assert "eval_num_sampling_steps" in flags and "eval_every" in flags


# ---- one vocabulary ------------------------------------------------------------------------------------


def face_options(name: str, face) -> list[tuple[str, str, str, str]]:
    """(command, flag, type, default) of every option of a face and its subcommands, as the docs write them."""
    from dit.io.config import _REQUIRED, _unwrap

    def tname(hint) -> str:
        if typing.get_origin(hint) is tuple:
            return tname(typing.get_args(hint)[0]) + "..."
        return " or ".join(a.__name__ for a in typing.get_args(hint)) or hint.__name__  # a number, or a word

    def dname(d) -> str:
        if d is _REQUIRED:
            return "required"
        if isinstance(d, bool):
            return "on" if d else "off"
        return "none" if d is None else " ".join(map(str, d)) if isinstance(d, tuple) else str(d)

    out, short = [], name.replace("scripts/", "").replace("studies/", "").replace(".py", "")
    for sub, f in face.commands.items():
        out += face_options(f"{name} {sub}", f)
    for flat, (attr, field) in face.fields.items():
        cls = face.sections[attr][0]
        hint, _ = _unwrap(typing.get_type_hints(cls)[field.name])
        out.append((short, face.flag(flat), tname(hint), dname(field.default)))
    return out


def vocabulary_table() -> dict[str, list[str]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    head = "| flag | type | default | commands with this default | other defaults, and why |"
    assert head in text, "docs/architecture.md lost its vocabulary table"
    rows = {}
    for line in text.split(head, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def vocabulary_problems(options, rows) -> list[str]:
    """What a vocabulary table gets wrong about the faces' options: a flag of two or more commands without a
    row, a row whose type and default no command has, a command with another type or default that the row's
    reasons do not name (its first word and its default), or a row for a flag that fewer than two take."""
    by_flag = collections.defaultdict(lambda: collections.defaultdict(list))
    for command, flag, tp, default in options:
        by_flag[flag][(tp, default)].append(command)
    shared = {flag: groups for flag, groups in by_flag.items() if sum(map(len, groups.values())) > 1}
    problems = [f"{flag}: a row for a flag fewer than two commands take" for flag in set(rows) - set(shared)]
    for flag, groups in sorted(shared.items()):
        if flag not in rows:
            problems.append(f"{flag}: taken by {sorted(c for g in groups.values() for c in g)}, no row")
            continue
        tp, default, _, why = rows[flag]
        if (tp, default) not in groups:
            problems.append(f"{flag}: the row says {tp} {default}; the commands have {sorted(groups)}")
            continue
        for (other_tp, other_default), commands in groups.items():
            if (other_tp, other_default) == (tp, default):
                continue
            for command in commands:
                if command.split()[0] not in why or other_default not in why:
                    problems.append(f"{flag}: {command} has {other_tp} {other_default}, not explained")
    return problems


def test_vocabulary():
    from helpers import faces

    from dit.model.options import CHOICES, SWITCHES

    # the block options' flags come from the registry through the one ModelSection: no rows (docs/architecture.md)
    generated = {"--" + name.replace("_", "-") for name in (*CHOICES, *SWITCHES)}
    options = [o for name, face in faces().items() if name != "dit.cost" for o in face_options(name, face)]
    options = [o for o in options if o[1] not in generated]
    assert len({o[1] for o in options}) > 100
    assert vocabulary_problems(options, vocabulary_table()) == []


def test_vocabulary_check_catches_a_second_default():
    """The test of the test: a command with an unexplained default, a new shared flag and a stale row."""
    rows = {"--seed": ["int", "0", "train", ""], "--gone": ["int", "1", "train", ""]}
    options = [("train", "--seed", "int", "0"), ("sample", "--seed", "int", "7"),
               ("train", "--lr", "float", "1e-4"), ("sample", "--lr", "float", "1e-4")]  # fmt: skip
    problems = vocabulary_problems(options, rows)
    assert any(p.startswith("--seed: sample has int 7") for p in problems)
    assert any(p.startswith("--lr:") and "no row" in p for p in problems)
    assert any(p.startswith("--gone:") for p in problems)
    rows["--seed"][3] = "sample: 7, because"
    assert not any(p.startswith("--seed") for p in vocabulary_problems(options, rows))


def test_a_store_run_resumes_and_samples_from_its_folder_alone(tmp_path, vae_dir, capsys, monkeypatch):
    """The run remembers: `train.py --results-dir R --resume auto` (nothing else) continues a latent-store
    run to the weights an uninterrupted run reaches, bit for bit, and `sample.py --ckpt R/checkpoints/LAST.pt`
    samples it with no other flag (the VAE, the model and its classes from the record)."""
    from helpers import make_image_folder, run_face

    from dit.extract import ExtractConfig, extract_features

    images = make_image_folder(tmp_path / "images", {"a": 4, "b": 4})
    store = tmp_path / "store"
    extract_features(
        ExtractConfig(feature_path=str(store), data_path=images, image_size=32, vae=vae_dir, num_workers=0)
    )
    full = tmp_path / "full"
    argv = ["--feature-path", str(store), "--depth", "2", "--hidden-size", "32", "--num-heads", "2",
            "--global-batch-size", "4", "--max-steps", "4", "--ckpt-every", "2", "--keep-last", "0",
            "--precision", "fp32", "--num-workers", "0", "--log-every", "1", "--peak-tflops", "0.05",
            "--device", "cpu", "--results-dir", str(full)]  # fmt: skip
    code, _, err = run_face("train.py", argv, capsys)
    assert code == 0, err
    run = tmp_path / "R"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints" / "0000002.pt", run / "checkpoints")  # a run stopped at step 2
    code, _, err = run_face("train.py", ["--results-dir", str(run), "--resume", "auto"], capsys)
    assert code == 0, err
    reached, expected = (load_checkpoint(r / "checkpoints" / "0000004.pt") for r in (run, full))
    for kind in ("model", "ema"):
        for name, tensor in expected[kind].items():
            assert torch.equal(reached[kind][name], tensor), f"{kind}.{name}"
    monkeypatch.chdir(tmp_path)
    code, out, err = run_face("sample.py", ["--ckpt", str(run / "checkpoints" / "0000004.pt")], capsys)
    assert code == 0, err
    assert (tmp_path / "sample.png").exists() and "wrote" in out
