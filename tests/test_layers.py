"""The layer rule of docs/architecture.md: foundations <- core <- cost <- data <- engine <- faces <- studies, no
import downward, no import cycle, and every module in a folder named for its layer or component."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [  # module prefixes (folders), top layer first
    ("foundations", ("dit.io",)),
    ("core", ("dit.model", "dit.models", "dit.objectives")),  # dit.models: the official drop-in (a re-export)
    ("cost", ("dit.cost",)),
    ("data", ("dit.data",)),
    (
        "engine",
        ("dit.runtime", "dit.checkpoint", "dit.train", "dit.sample", "dit.eval", "dit.bench", "dit.extract"),
    ),
    (
        "faces",
        ("dit.quickstart", "dit.cost.__main__", "dit.eval.__main__", "dit.checkpoint.__main__"),
    ),  # python -m
    ("studies", ("studies",)),  # studies/, outside dit/: a study imports its siblings by their bare names
]
LOOSE = {"__init__.py", "models.py"}  # the only modules directly in dit/: the package and the official drop-in
STUDIES = ROOT / "studies"


def python_files(*folders: str) -> list[Path]:
    """The scripts at the repository's root and every module under ``folders``."""
    return [*ROOT.glob("*.py"), *(p for d in folders for p in (ROOT / d).rglob("*.py"))]


def layer_of(module: str) -> int:
    """The layer of the longest prefix that names ``module`` (a package's ``__main__`` is a face)."""
    found = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if module == p or module.startswith(p + ".")]  # fmt: skip
    if not found:
        raise AssertionError(f"{module} is in no layer: add it to docs/architecture.md and to LAYERS")
    return max(found)[1]


def _imported(tree: ast.Module) -> list[str]:
    """Every module name an import statement of ``tree`` names (relative imports left out: dit uses none)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def _as_layered(name: str) -> str:
    """A study's sibling module, imported by its bare name, as ``studies.NAME``; any other name as it is."""
    return f"studies.{name}" if (STUDIES / f"{name.split('.')[0]}.py").is_file() else name


def test_no_module_imports_a_layer_below_it():
    bad = []
    for path in sorted((ROOT / "dit").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module == "dit":
            continue
        mine = layer_of(module)
        for name in map(_as_layered, _imported(ast.parse(path.read_text()))):
            if (name.startswith(("dit.", "studies.")) or name == "studies") and layer_of(name) > mine:
                bad.append(f"{module} ({LAYERS[mine][0]}) imports {name} ({LAYERS[layer_of(name)][0]})")
    assert not bad, "\n".join(bad)


def test_a_framework_module_importing_a_study_is_found():
    """The rule's own check: dit/ importing ``studies.x`` or a study by its bare name is a layer below."""
    study = next(STUDIES.glob("*.py")).stem
    names = map(_as_layered, _imported(ast.parse(f"import {study}\nfrom studies.x import y\nimport numpy")))
    assert [layer_of(n) for n in names if n.startswith("studies.")] == [len(LAYERS) - 1] * 2


def test_studies_import_the_framework_and_each_other_only():
    """A study reaches the framework by ``dit.`` imports and its siblings by name, never scripts/ or a face's
    module at the repository's root, so it runs as ``python studies/NAME.py`` from the root."""
    faces = {p.stem for p in (*ROOT.glob("*.py"), *(ROOT / "scripts").glob("*.py"))}
    bad = []
    for path in sorted(STUDIES.glob("*.py")):
        for name in _imported(ast.parse(path.read_text())):
            if name.split(".")[0] in faces | {"scripts", "tests", "helpers"}:
                bad.append(f"studies/{path.name} imports {name}")
    assert not bad, bad


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted((ROOT / "dit").rglob("*.py"))}  # fmt: skip


def _module_level_imports(tree: ast.Module):
    """The imports that run when the module is imported: not those inside functions or under TYPE_CHECKING."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            todo.extend(ast.iter_child_nodes(node))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (the graph is small)."""
    reaches = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            if (m := todo.pop()) not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        reaches[start] = seen
    return sorted({tuple(sorted(n for n in reaches[m] if m in reaches[n])) for m in graph if m in reaches[m]})


def test_import_cycles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_dit_modules():
    """Module-level imports only; a submodule's import of its own package is not an edge (the package is always
    initialised first, and a package re-exporting its submodules would otherwise be a cycle by construction)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        graph[module] = set()
        for node in _module_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            graph[module] |= {n for n in names if n in modules and n != module and not module.startswith(n + ".")}
    assert not import_cycles(graph), import_cycles(graph)


def test_no_loose_module_in_dit():
    """Every module lives in a folder named for its layer or component (docs/architecture.md, Layers)."""
    loose = sorted(p.name for p in (ROOT / "dit").glob("*.py") if p.name not in LOOSE)
    assert not loose, f"move {loose} into the folder of their layer or component"


def test_cost_never_imports_the_engine_or_torch_at_module_level():
    """dit-cost answers without torch: nothing it imports at module level may import torch."""
    for path in (ROOT / "dit" / "cost").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if path.stem in ("measured", "memory", "meter", "plots"):
                    continue  # imported by the engine, or lazily by the command
                assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{path.name} imports torch"


def test_no_code_reads_the_shared_folder():
    """Users clone the repo alone: a path into the shared folder beside it may stand in a comment, never in code."""
    needle, offenders = "shared" + "/", []  # built, so that this test does not find itself
    for path in python_files("dit", "scripts", "studies", "tests"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if needle in node.value and node.value.lstrip().startswith(("..", "/", needle)):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_only_the_runtime_sets_the_matmul_mode():
    """TF32 and the matmul precision are set in dit/runtime/ alone (cost measures peaks inside its flags)."""
    flags = {
        "fp32_precision",
        "allow_tf32",
        "set_float32_matmul_precision",
        "allow_bf16_reduced_precision_reduction",
    }
    offenders = []
    for path in python_files("dit", "scripts", "studies"):
        if "runtime" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            sets = any(isinstance(t, ast.Attribute) and t.attr in flags for t in targets)
            calls = isinstance(node, ast.Call) and getattr(node.func, "attr", None) in flags
            if sets or calls:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_function_is_longer_than_80_lines():
    """A function a reader cannot take in at once is split into named parts."""
    long = {}
    for path in sorted((ROOT / "dit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_the_trainer_names_no_parallelism():
    """Wrapping, gradient sync, gathering and the global norm are the Parallelism object's (dit/train/parallel.py)."""
    text = "".join((ROOT / "dit" / "train" / name).read_text().lower() for name in ("trainer.py", "parts.py"))
    assert not [word for word in ("fsdp", "shard", "ddp", "distributeddataparallel") if word in text]
