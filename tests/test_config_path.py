"""train.py's config path: a face's ``given`` (an argv scan) names the options argparse reads from argv (every
flag and alias of train.py's face, ``--no-x``, ``--flag=value``, abbreviations, nothing after ``--``), and a
resume builds its config once, from the record read without the weights."""

import argparse

import pytest

from dit.train.config import TRAIN_FACE


def _read_by_argparse(argv: list[str]) -> set[str]:
    """The oracle: argparse run again over argv with every default suppressed, so that only what argv set stays."""
    parser = TRAIN_FACE.parser()
    for a in parser._actions:
        a.default, a.required = argparse.SUPPRESS, False
    return set(vars(parser.parse_known_args(argv)[0])) - {"config", "help"}


def _cases() -> list[list[str]]:
    cases = []
    for a in TRAIN_FACE.parser()._actions:
        if not a.option_strings or a.dest in ("help", "config"):
            continue
        for s in a.option_strings:
            if isinstance(a, argparse.BooleanOptionalAction):
                cases.append([s])
            elif a.choices:
                cases.append([s, str(list(a.choices)[0])])
            elif a.nargs == "+":
                cases.append([s, "1", "2"])
            else:
                cases.append([f"{s}=5"] if len(cases) % 2 else [s, "5"])
    return cases + [
        ["--max-st", "5"], ["--lr", "1e-3", "--", "x"], ["--no-ro"], ["--eval-cfg-scale", "2", "--lr=3"],
        ["--config", "x.yaml", "--lr", "3"], ["--lr", "3", "--no-learn-sigma", "--learn-sigma"],
    ]  # fmt: skip


CASES = _cases()


def test_the_cases_cover_every_option_string():
    strings = {s for a in TRAIN_FACE.parser()._actions for s in a.option_strings} - {"-h", "--help", "--config"}
    assert strings <= {argv[0].split("=")[0] for argv in CASES}
    assert len(CASES) > 100


@pytest.mark.parametrize("argv", CASES, ids=" ".join)
def test_given_is_what_argparse_reads(argv):
    want = _read_by_argparse(argv)
    assert want, argv  # every case sets something
    assert TRAIN_FACE.given(argv) == want


def test_a_resume_builds_its_config_once_and_reads_the_checkpoint_once_for_the_record_and_once_for_the_state(
    tmp_path, monkeypatch, capsys
):
    from test_train import Pixels, tiny_config

    import dit.checkpoint.format as checkpoint_format
    from dit.train import TrainConfig, resolve, train

    train(tiny_config(tmp_path, max_steps=1), Pixels())
    builds, reads = [], []
    check, load = TrainConfig.__post_init__, checkpoint_format.load_checkpoint
    monkeypatch.setattr(TrainConfig, "__post_init__", lambda self: builds.append(check(self)))
    monkeypatch.setattr(
        checkpoint_format, "load_checkpoint", lambda path, **kw: reads.append(kw.get("mmap")) or load(path, **kw)
    )
    cfg = resolve(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--max-steps", "2"])
    assert train(cfg, Pixels())["step"] == 2
    assert len(builds) == 1, "the config is built and checked once"
    assert reads == [True, False], "the record without the weights, then the whole checkpoint for the state"
    assert "changed on this resume: --max-steps 2 (recorded 1)" in capsys.readouterr().err
