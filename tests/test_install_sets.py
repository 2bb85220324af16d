"""Every face's third-party imports are provided by an install set a user is told to run.

The README's first command failed on a fresh machine (scipy, imported by the quick start's evaluation, was
in no set the quick start installed) while every test passed in a `.venv` that happened to have it. This
reads the imports reachable from each face statically (ast; lazy imports inside functions count, a
``typing.TYPE_CHECKING`` block does not), and checks each against core (``install_requires``) plus the
extras the docs name for that face. An optional import is covered where it is guarded: by
``dit.io.errors.require(module, extra, ...)`` (the extra must provide it; that file's plain imports of the
module run after the check) or by ``try: import ... except
ImportError: raise UserError(...)`` (some extra must provide it).
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACES = [
    "train.py",
    "sample.py",
    "extract_features.py",
    *sorted(str(p.relative_to(ROOT)) for d in ("scripts", "studies") for p in (ROOT / d).glob("*.py")),
    "dit/cost/__main__.py",  # python -m dit.cost, dit-cost
    "dit/eval/__main__.py",  # python -m dit.eval
    "dit/quickstart/run.py",  # python -m dit.quickstart
]
# Extras the docs tell the users of a face to install for its unguarded imports (every other optional import
# is guarded). A pair here must be written down: the face's name and the extra in one doc file.
FACE_EXTRAS: dict[str, set[str]] = {"studies/train_digit_encoder.py": {"repa"}}  # docs/repa.md


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def install_sets(setup_cfg: Path) -> tuple[set[str], dict[str, set[str]]]:
    """(core distributions, {extra: distributions}) from setup.cfg, names normalised."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)

    def names(text: str) -> set[str]:
        return {
            _norm(re.match(r"[A-Za-z0-9._-]+", line.strip()).group()) for line in text.splitlines() if line.strip()
        }

    extras = {k: names(v) for k, v in cfg["options.extras_require"].items()} if cfg.has_section(
        "options.extras_require"
    ) else {}  # fmt: skip
    return names(cfg["options"]["install_requires"]), extras


@dataclass(frozen=True)
class Use:
    module: str  # the top-level import name
    where: str  # file:line
    extra: str | None = None  # require(module, extra): this extra must provide it
    guarded: bool = False  # try/except ImportError -> UserError


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _guards_import(node: ast.Try) -> bool:
    """except ImportError/ModuleNotFoundError whose body raises UserError (the one-line error)."""
    for handler in node.handlers:
        caught = handler.type
        names = [getattr(e, "id", "") for e in (caught.elts if isinstance(caught, ast.Tuple) else [caught])]
        if {"ImportError", "ModuleNotFoundError"} & set(names):
            for sub in ast.walk(handler):
                if isinstance(sub, ast.Raise) and sub.exc is not None:
                    call = sub.exc.func if isinstance(sub.exc, ast.Call) else sub.exc
                    if getattr(call, "id", None) == "UserError":
                        return True
    return False


def file_uses(path: Path, package: str) -> tuple[list[Use], list[str]]:
    """(imports of other distributions, first-party modules imported) of one file."""
    tree, rel = ast.parse(path.read_text()), path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    uses, local = [], []

    def visit(node, guarded: bool):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, guarded)
            return
        if isinstance(node, ast.Try):
            inner = guarded or _guards_import(node)
            for child in node.body:
                visit(child, inner)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif node.level:  # relative: within this package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                modules = [f"{base}.{node.module}" if node.module else base]
            else:
                modules = [node.module]
            for name in modules:
                if isinstance(node, ast.ImportFrom):
                    local.extend(
                        f"{name}.{a.name}" for a in node.names
                    )  # `from dit.x import y`: y may be a module
                local.append(name)
                uses.append(Use(name.split(".")[0], f"{rel}:{node.lineno}", guarded=guarded))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and len(node.args) >= 2:
            module, extra = node.args[0], node.args[1]
            if isinstance(module, ast.Constant) and isinstance(extra, ast.Constant):
                uses.append(Use(module.value.split(".")[0], f"{rel}:{node.lineno}", extra=extra.value))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    # An import in a file that calls require() for the same module is that require's: it runs after the check.
    required = {u.module: u.extra for u in uses if u.extra is not None}
    uses = [Use(u.module, u.where, extra=required[u.module]) if u.module in required else u for u in uses]
    return uses, local


def reachable_uses(face: Path, root: Path = ROOT) -> list[Use]:
    """Every third-party import reachable from ``face`` through first-party modules (dit.*, its folder's)."""

    def module_path(name: str) -> Path | None:
        parts = name.split(".")
        if parts[0] == "dit" or (face.parent / f"{parts[0]}.py").exists():
            base = root if parts[0] == "dit" else face.parent
            for candidate in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
                if candidate.is_file():
                    return candidate
        return None

    seen, todo, found = set(), [(face, "")], []
    while todo:
        path, package = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        uses, local = file_uses(path, package)
        for name in local:
            if (target := module_path(name)) is not None:
                pkg = name if target.name == "__init__.py" else name.rpartition(".")[0]
                todo.append((target, pkg))
                parents = name.split(".")  # importing dit.a.b runs dit/__init__.py and dit/a/__init__.py
                for i in range(1, len(parents)):
                    if (init := root.joinpath(*parents[:i], "__init__.py")).is_file():
                        todo.append((init, ".".join(parents[:i])))
        first_party = {"dit", "__future__"} | {p.stem for p in face.parent.glob("*.py")}
        found += [u for u in uses if u.module not in first_party and u.module not in sys.stdlib_module_names]
    return found


def uncovered(faces: list[Path], core: set[str], extras: dict[str, set[str]], face_extras=None) -> list[str]:
    """One line per import that no install set provides (for this face)."""
    providers = {
        top: {_norm(d) for d in dists} for top, dists in importlib.metadata.packages_distributions().items()
    }
    anywhere = core | set().union(*extras.values())
    problems = []
    for face in faces:
        name = str(face.relative_to(ROOT)) if face.is_relative_to(ROOT) else face.name
        allowed = core | set().union(*(extras.get(e, set()) for e in (face_extras or {}).get(name, ())))
        for use in reachable_uses(face):
            dists = providers.get(use.module, set())
            if use.extra is not None:
                if not dists & extras.get(use.extra, set()):
                    problems.append(f"{use.where}: require({use.module!r}, {use.extra!r}): [{use.extra}] lacks it")
            elif not dists & (anywhere if use.guarded else allowed):
                why = (
                    "no install set provides it" if not dists & anywhere else "only an extra this face's docs omit"
                )
                problems.append(f"{name} -> {use.where}: import {use.module} ({why})")
    return sorted(set(problems))


def test_every_face_import_is_provided_by_an_install_set():
    core, extras = install_sets(ROOT / "setup.cfg")
    problems = uncovered([ROOT / f for f in FACES], core, extras, FACE_EXTRAS)
    assert not problems, "\n".join(problems)


def test_the_documented_face_extras_are_written_down():
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for face, needed in FACE_EXTRAS.items():
        for extra in needed:
            assert any(face in d.read_text() and f"[{extra}]" in d.read_text() for d in docs), (face, extra)


def test_the_check_fails_on_an_import_no_install_set_provides(tmp_path):
    """A test of the test: a new face that imports an uninstallable module, or guards an import with an
    extra that does not hold it, is reported; stdlib, first-party and covered imports are not."""
    face = tmp_path / "new_face.py"
    face.write_text(
        "import os\nimport numpy\nfrom helper_mod import thing\nfrom dit.io.errors import require\n\n"
        "def optional():\n    require('scipy', 'vae', 'a job')\n    import no_such_package_xyz\n\n"
        "if False:\n    pass\n"
    )
    (tmp_path / "helper_mod.py").write_text("import yaml\nimport another_missing_pkg\nthing = 1\n")
    core, extras = install_sets(ROOT / "setup.cfg")
    problems = uncovered([face], core, extras)
    assert any("no_such_package_xyz" in p and "no install set" in p for p in problems), problems
    assert any("another_missing_pkg" in p for p in problems), "reached through a first-party module"
    assert any("require('scipy', 'vae')" in p for p in problems), problems
    assert not any(m in p for p in problems for m in ("numpy", "yaml", " os")), problems
    assert len(problems) == 3
    no_scipy = core - {"scipy"}  # the defect that broke the quick start: FID's scipy outside core
    assert any("import scipy" in p for p in uncovered([ROOT / "dit/quickstart/run.py"], no_scipy, extras)), (
        "the quick start imports scipy through its evaluation"
    )
