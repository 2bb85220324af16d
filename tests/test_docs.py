"""What the docs show is real: every command in README, docs/ and gpu_bench.sh parses with the flags of
today's code, and every docs/results file they cite is committed."""

import re
import shlex
from pathlib import Path

import pytest
from helpers import FACE_MODULES, faces

from dit.io.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "gpu_bench.sh"]


def _parsers():
    """{name: a function parsing argv the way that command does}."""
    out = {}
    for name, f in faces().items():
        out[name] = f.parse
    return out


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
                if name in FACE_MODULES:
                    if name == "dit-cost" and i > 0:
                        break  # prose that names the command
                    argv = [w for w in words[i + 1 :] if not w.startswith(("$", "|", ">")) and w != "..."]
                    if name == "dit.eval" and argv[:1] == ["ref"]:
                        name, argv = "dit.eval ref", argv[1:]
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
    except UserError as e:
        pytest.fail(f"{page}: `{name} {' '.join(argv)}` is refused: {e}")


def _aliases(face) -> dict[str, str]:
    """{alias: its flag} of a face (and its commands)."""
    found = {}
    for f in [face, *face.commands.values()]:
        for flat, (attr, field) in f.fields.items():
            prefix = f.sections[attr][1].replace("_", "-")
            for alias in field.metadata["aliases"]:
                found[alias.replace("--", "--" + prefix, 1)] = f.flag(flat)
    return found


@pytest.mark.parametrize("page,name,argv", commands(), ids=lambda x: str(x)[:60])
def test_documented_commands_use_one_spelling(page, name, argv):
    """The docs spell every flag its one way; the official scripts' spellings parse too (aliases), and only
    docs/finetuning.md's table of official commands may show them."""
    if page == "finetuning.md":
        return
    aliases = _aliases(faces()[name])
    used = [w.split("=")[0] for w in argv if w.startswith("--")]
    wrong = [f"{w} (say {aliases[w]})" for w in used if w in aliases]
    assert not wrong, f"{page}: `{name} {' '.join(argv)}` uses {', '.join(wrong)}"


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


def test_every_checkpoint_path_shown_is_a_folder_a_run_writes():
    """sample.py --help showed results/000-DiT-XL-2/..., the README results/DiT-XL-2-256/... and the default is
    results/run: a run folder shown in a page, a help text or a docstring is one a command writes without a
    flag (train.py's default, a preset's results_dir, the quick start's run), or one the same text passes."""
    import yaml

    from dit.quickstart import FACE as QUICKSTART
    from dit.train.config import TRAIN_FACE

    written = {TRAIN_FACE.fields["results_dir"][1].default, QUICKSTART.fields["results_dir"][1].default + "/run"}
    written |= {yaml.safe_load(p.read_text())["results_dir"] for p in (ROOT / "configs").glob("*.yaml")}
    sources = [*PAGES, *ROOT.glob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "dit").rglob("*.py")]
    shown = []
    for path in sources:
        text = path.read_text()
        passed = set(re.findall(r"--results-dir[ =]([\w./-]+)", text))
        for folder in re.findall(r"(results/[\w.-]+(?:/run)?)/checkpoints/", text):
            if folder.endswith("..."):
                continue  # elided on purpose
            shown.append(folder)
            assert folder in written | passed, f"{path.relative_to(ROOT)}: {folder} (runs write {sorted(written)})"
    assert len(shown) > 5
