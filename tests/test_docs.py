"""What the docs show is real: every command in README, docs/ and gpu_bench.sh parses with the flags of
today's code, and every docs/results file they cite is committed."""

import re
import shlex
from pathlib import Path

import pytest
from helpers import face

from dit.config import parse_command, parse_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "gpu_bench.sh"]


def _parsers():
    from dit import bench
    from dit.cost.__main__ import COMMANDS
    from dit.extract import ExtractConfig
    from dit.quickstart import QuickstartConfig
    from dit.sample.config import FidConfig, SampleConfig
    from dit.train import TrainConfig

    cost = {name: (cls, "") for name, (cls, _) in COMMANDS.items()}
    return {
        "train.py": lambda argv: parse_config(TrainConfig, argv),
        "sample.py": lambda argv: parse_config(SampleConfig, argv),
        "scripts/sample_ddp.py": lambda argv: parse_config(FidConfig, argv),
        "extract_features.py": lambda argv: parse_config(ExtractConfig, argv),
        "dit.quickstart": lambda argv: parse_config(QuickstartConfig, argv),
        "scripts/export_diffusers.py": lambda argv: parse_config(
            face("scripts/export_diffusers.py").ExportConfig, argv
        ),
        "scripts/benchmark.py": lambda argv: parse_command(bench.MODES, argv, "benchmark"),
        "dit-cost": lambda argv: parse_command(cost, argv, "dit-cost"),
        "dit.cost": lambda argv: parse_command(cost, argv, "dit-cost"),
    }


def commands():
    """(page, face, argv) for every command line on the pages: fenced blocks, `inline code`, shell lines."""
    found = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        if page.suffix == ".sh":
            snippets = text.splitlines()
        else:  # `inline code` outside fenced blocks, and every line inside them
            blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
            prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
            inline = [c for c in re.findall(r"`([^`\n]+)`", prose) if len(c.split()) > 2]  # not `flag` mentions
            snippets = inline + [line for b in blocks for line in b.splitlines()]
        for snippet in snippets:
            if "..." in snippet:
                continue  # elided on purpose
            snippet = re.sub(r"\[[^\]]*\]", "", snippet)  # [optional flags]
            snippet = snippet.split(" # ")[0].split("  #")[0].strip().strip('"')
            try:
                words = shlex.split(snippet)
            except ValueError:
                continue
            for i, word in enumerate(words):
                name = word.removeprefix("$py ").removeprefix("./")
                if name in ("train.py", "sample.py", "scripts/sample_ddp.py", "extract_features.py",
                            "scripts/export_diffusers.py", "scripts/benchmark.py", "dit-cost", "dit.cost",
                            "dit.quickstart"):  # fmt: skip
                    if name == "dit-cost" and i > 0:
                        break  # prose that names the command
                    argv = [w for w in words[i + 1 :] if not w.startswith(("$", "|", ">")) and w != "..."]
                    script = name not in ("scripts/benchmark.py", "dit-cost", "dit.cost")
                    if argv and (argv[0].startswith("--") if script else argv[0].isalpha()):
                        found.append((page.name, name, tuple(argv)))
                    break
    return sorted(set(found))


@pytest.mark.parametrize("page,name,argv", commands(), ids=lambda x: str(x)[:60])
def test_documented_command_parses(page, name, argv):
    try:
        _parsers()[name](list(argv))
    except SystemExit as e:
        if e.code == 0:  # --help
            return
        pytest.fail(f"{page}: `{name} {' '.join(argv)}` does not parse (exit {e.code})")


def test_there_are_commands_to_check():
    names = {name for _, name, _ in commands()}
    assert {"train.py", "sample.py", "dit-cost", "scripts/benchmark.py", "extract_features.py"} <= names


def test_every_cited_result_file_is_committed():
    cited = {m for page in PAGES for m in re.findall(r"docs/results/[\w./-]+\.json", page.read_text())}
    missing = sorted(p for p in cited if not (ROOT / p).is_file())
    assert not missing, f"cited but not in the repository: {missing}"


@pytest.mark.parametrize(
    "name,argv",
    [(n, ["--help"]) for n in ("train.py", "sample.py", "scripts/sample_ddp.py", "extract_features.py", "dit.quickstart",
                               "scripts/export_diffusers.py")]
    + [("dit-cost", [c, "--help"]) for c in ("flops", "train", "sample", "memory", "peaks", "plot")]
    + [("scripts/benchmark.py", [m, "--help"]) for m in ("train", "sample", "accounting", "reader", "loss", "profile",
                                                          "attention", "repeat", "precision")],
)  # fmt: skip
def test_every_face_prints_its_help(name, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parsers()[name](argv)
    assert exit_.value.code == 0 and "--" in capsys.readouterr().out
