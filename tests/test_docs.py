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
    sources = [*PAGES, *ROOT.glob("*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("studies/*.py")]
    sources += (ROOT / "dit").rglob("*.py")
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


# a command in a snippet: `python -m dit.X`, dit-cost, a face script; torchrun and pipes end the previous one
_COMMAND = re.compile(
    r"python -m (dit\.[a-z_]+)|(dit-cost|torchrun)|((?:scripts/|studies/)?[a-z_]+\.py)|([|;&]|\$\()"
)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*)(?![\w*-])")
HYPOTHETICAL = {"--layer-scale", "--p2-gamma"}  # docs/architecture.md's worked examples of additions not built
OTHER_TOOLS = {"--nproc_per_node": "torchrun", "--nnodes": "torchrun", "--node_rank": "torchrun",
               "--rdzv-endpoint": "torchrun", "--rdzv_backend": "torchrun", "--rdzv_endpoint": "torchrun",
               "--rdzv_id": "torchrun", "--signals-to-handle": "torchrun", "--shutdown-timeout": "torchrun",
               "--num_processes": "accelerate", "--mixed_precision": "accelerate", "--signal": "sbatch",
               "--local-dir": "huggingface-cli", "--logdir": "tensorboard", "--no-deps": "pip", "--isolated": "pip",
               "--collect-only": "pytest", "--dry-run": "scripts/gpu_validate.sh"}  # fmt: skip
FOLDERS = ("scripts", "studies")  # the command lines outside dit/ and the root
FACE_NAMES = [
    *FACE_MODULES,
    "dit.checkpoint",
    *(f"{d}/{p.name}" for d in FOLDERS for p in (ROOT / d).glob("*.py")),
]


def _flags_of(name: str) -> set[str] | None:
    """Every long option of the face ``name`` (its parser, subcommands included; a script that builds an
    argparse parser in ``main``: its ``add_argument`` calls), or None for a name that is no face."""
    import argparse

    def options(parser) -> set[str]:
        out = set()
        for action in parser._actions:
            out |= {s for s in action.option_strings if s.startswith("--")}
            if isinstance(action, argparse._SubParsersAction):
                out = out.union(*(options(p) for p in action.choices.values()))
        return out

    known = {"dit-cost": "dit.cost", "dit.eval": "dit.eval"}
    if name in known or name in FACE_MODULES:
        found = options(faces()[known.get(name, name)].parser())
        return found | options(faces()["dit.eval ref"].parser()) if name == "dit.eval" else found
    path = ROOT / (f"{name.replace('.', '/')}/__main__.py" if name.startswith("dit.") else name)
    if not path.is_file():
        return None
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text())) | {"--help"}


def flag_mentions():
    """(page, face, flag) for every flag in a `code span` or a fenced block's line of README.md and docs/: the
    face is the one named before it there (or right before it in prose: train.py's `--eval-*`), else None."""
    found = set()
    for page in PAGES[:-1]:
        text = page.read_text().replace("\\\n", " ")
        blocks = [line for b in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S) for line in b.splitlines()]
        prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
        spans = blocks + re.findall(r"`([^`\n]+)`", prose)
        spans += [" ".join(m) for m in re.findall(r"([\w./-]+\.py)`?(?:'s)? `(--[a-z][\w*-]*)", prose)]
        for span in spans:
            name, start = None, 0
            for m in [*_COMMAND.finditer(span), None]:
                found |= {(page.name, name, f) for f in _FLAG.findall(span[start : m.start() if m else None])}
                if m is None:
                    break
                name, start = m.group(1) or m.group(3), m.end()  # None after torchrun, a pipe, a `;`
                if name and not (ROOT / name).is_file():
                    name = next((f"{d}/{name}" for d in FOLDERS if (ROOT / d / name).is_file()), name)
                name = "dit-cost" if m.group(2) == "dit-cost" else name
    return sorted(found, key=str)


def test_every_flag_the_docs_name_exists_in_its_face():
    """docs/architecture.md showed `--keep-every` while train.py refused it: a flag named beside a face
    (`train.py --x`, sample.py's `--x`) is one that face takes, and a flag named alone one that some face takes
    (or another tool the docs run: OTHER_TOOLS), in README.md and every docs/ page."""
    mentions = flag_mentions()
    assert len({face for _, face, _ in mentions}) > 10
    every = set().union(*(_flags_of(n) for n in FACE_NAMES)) | HYPOTHETICAL
    wrong = []
    for page, name, flag in mentions:
        known = every | set(OTHER_TOOLS) if name is None else _flags_of(name)
        if known is not None and flag not in known | HYPOTHETICAL:
            wrong.append(f"{page}: {name or 'no face'} {flag}")
    assert not wrong, "flags no face takes:\n" + "\n".join(wrong)
    assert not HYPOTHETICAL & set().union(*(_flags_of(n) for n in FACE_NAMES)), "built now: drop from HYPOTHETICAL"
