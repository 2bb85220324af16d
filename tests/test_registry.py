"""The registry's names reach every face: a size added to ``_SIZES`` is in ``DiT_models``, ``dit-cost --all``
and the help, and the patch-1 names are there too (docs/architecture.md, "Where to change what")."""

import json

import pytest

from dit.cost.__main__ import main as cost_main
from dit.model import config
from dit.model.dit import DiT_models
from dit.train import TRAIN_FACE


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        cost_main([*argv, "--help"])
    return capsys.readouterr().out


def test_a_size_added_to_the_registry_reaches_dit_models_dit_cost_all_and_the_help(monkeypatch, capsys):
    monkeypatch.setitem(config._SIZES, "T", (2, 64, 4))
    added = [f"DiT-T/{p}" for p in config.PATCH_SIZES]
    assert all(name in DiT_models for name in added) and len(DiT_models) == len(config.model_names())
    assert DiT_models["DiT-T/1"](input_size=4, num_classes=10).config.depth == 2
    assert config.registry_name(config.model_config("DiT-T/4")) == "DiT-T/4"
    assert cost_main(["flops", "--all", "--image-size", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in rows] == list(config.model_names()) and set(added) <= {r["model"] for r in rows}
    assert all(name in _help(capsys, ["flops"]) for name in added)
    assert all(name in TRAIN_FACE.parser().format_help() for name in added)


def test_the_helps_list_the_patch_1_names(capsys):
    for text in (_help(capsys, ["train"]), TRAIN_FACE.parser().format_help()):
        assert all(f"DiT-{size}/1" in text for size in ("S", "B", "L", "XL"))


def test_an_unknown_patch_is_refused_with_the_names():
    with pytest.raises(config.UserError, match="DiT-XL/1, DiT-XL/2"):
        config.model_config("DiT-XL/3")
