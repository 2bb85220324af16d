"""Configuration sections: checked once where they are built, frozen after, small, saved with the run, and
read back by a resume that is given nothing else."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dit
from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.config import Section
from dit.errors import UserError
from dit.train import TRAIN_FACE, TrainConfig, parse_train_config, train

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
        parse_train_config(["--config", str(preset)])
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
        parse_train_config(argv)
    assert str(e.value).startswith(flag) or flag in str(e.value), str(e.value)


def test_yaml_presets_fill_the_same_sections_as_flags(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: DiT-B/4\nlr: 3.0e-4\neval_every: 0\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("model:\n  model: DiT-B/4\noptim:\n  lr: 3e-4\n")  # PyYAML reads 3e-4 as a string
    a, b = parse_train_config(["--config", str(flat)]), parse_train_config(["--config", str(nested)])
    c = parse_train_config(["--model", "DiT-B/4", "--lr", "3e-4"])
    assert a == b == c and a.optim.lr == 3e-4 and a.model.model == "DiT-B/4"
    assert parse_train_config(["--config", str(flat), "--lr", "1e-3"]).optim.lr == 1e-3  # flags override it


def test_the_record_round_trips_through_config_yaml(tmp_path):
    import yaml

    cfg = TrainConfig.of(max_steps=7, lr=2e-4, eval_every=0, allow_changes=["lr"], resume="auto")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.record()))
    assert parse_train_config(["--config", str(path)]) == cfg


class Pixels(torch.utils.data.Dataset):
    """The data set tests/data/checkpoint_v1/make.py trained on."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, 8, 8, generator=g) * 2 - 1, i % 2


def test_a_checkpoint_of_the_flat_format_resumes_to_the_weights_it_reached(tmp_path):
    """tests/data/checkpoint_v1 was written before the sections (a flat run config): it resumes, from its own
    record alone, and its next step gives the weights the old code reached, bit for bit."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "0000001.pt").write_bytes((DATA / "checkpoint_v1" / "0000001.pt").read_bytes())
    cfg = parse_train_config(
        ["--results-dir", str(run), "--resume", "auto", "--max-steps", "2", "--device", "cpu"]
    )
    assert (cfg.model.hidden_size, cfg.model.image_size, cfg.data.vae, cfg.optim.lr) == (16, 8, "none", 1e-3)
    train(cfg, Pixels())
    reached = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    expected = load_file(DATA / "checkpoint_v1" / "step2_weights.safetensors")
    for kind in ("model", "ema"):
        for name, tensor in reached[kind].items():
            assert torch.equal(tensor, expected[f"{kind}.{name}"]), f"{kind}.{name}"
    assert isinstance(reached["config"]["model"], dict), "written again in the sections' layout"


def test_a_resumed_run_takes_its_settings_from_the_record_and_names_a_changed_one(tmp_path, capsys):
    from test_train import Pixels as Digits
    from test_train import tiny_config

    cfg = tiny_config(tmp_path, max_steps=2, lr=5e-4, log_every=1)
    train(cfg, Digits())
    resumed = parse_train_config(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--max-steps", "3"])
    assert resumed.replace(max_steps=2, resume=None) == cfg, "every option but the given ones from the record"
    capsys.readouterr()
    train(resumed, Digits())
    assert "changed on this resume: --max-steps 3 (recorded 2)" in capsys.readouterr().err
    with pytest.raises(
        UserError, match="lr: 0.0005 -> 0.001"
    ):  # a recipe field is refused without --allow-changes
        train(
            parse_train_config(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--lr", "1e-3"]),
            Digits(),
        )


def test_the_trainer_flags_are_the_sections_fields():
    """One flag per field, and no field spelled twice across sections."""
    flags = {a.dest for a in TRAIN_FACE.parser()._actions} - {"help", "config"}
    assert flags == set(TRAIN_FACE.fields)
    assert "eval_num_sampling_steps" in flags and "eval_every" in flags
