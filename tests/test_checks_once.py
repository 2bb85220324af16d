"""Each check once, where the value is born: a flag whose field carries a bound (``ge``, ``gt``, ``le``, ``lt``,
``choices``) is refused by its section, so no ``raise`` elsewhere in dit/ should test it again.

What this finds: a ``raise`` whose literal text names a bounded flag followed (within 60 characters) by a
bound's wording ("must be", "positive", ">= 1", "in (0, 1]", "one of"). What it misses: a check whose flag
name arrives in a variable, and a repeat worded otherwise. ``python tests/test_checks_once.py`` lists the
repeats.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = {"ge", "gt", "le", "lt", "choices"}
WORDING = re.compile(r"must be|positive|>= ?\d|> ?0\b|<= ?1\b|in \(0, 1\]|one of")

# (flag, module): the hits left, each with why. dit-cost's own repeats are gone; the rest lie outside it.
ALLOWED = {
    # Library checks that also serve a field with no bound yet (dit/bench/config.py: benchmark sample's
    # --guidance-scale and --peak-tflops; that package is being split), or values from elsewhere.
    ("--guidance-scale", "dit/cost/analytic.py"): "bench sample's --guidance-scale has no ge=1",
    ("--peak-tflops", "dit/cost/peaks.py"): "bench's --peak-tflops has no gt=0",
    ("--precision", "dit/cost/peaks.py"): "the runtime and the meter pass precisions of their own",
    ("--image-size", "dit/cost/analytic.py"): "a multiple of the VAE's downsampling: a property of the VAE config",
    # Repeats outside dit-cost, left to their owners.
    ("--guidance-interval", "dit/objectives/samplers.py"): "check_guidance_interval repeats the field and check()",
    ("--num-sampling-steps", "dit/objectives/samplers.py"): "sampling_plan() repeats ge=1 (and >= 2 for DDPM)",
    ("--sampler", "dit/objectives/samplers.py"): "sampling_plan() repeats the choices",
    ("--guidance-scale", "dit/sample/generate.py"): "the sampler repeats ge=1",
    ("--guidance-channels", "dit/sample/generate.py"): "the sampler repeats the choices",
    ("--init-from-weights", "dit/train/init.py"): "init_from repeats the choices",
    ("--precision", "dit/runtime/precision.py"): "Precision repeats the choices (also built from a record)",
    # Not repeats: checks of another kind whose wording names a bounded flag.
    ("--time-shift", "dit/objectives/respacing.py"): "two respaced steps on one timestep",
    ("--sampler", "dit/objectives/objective.py"): "a sampler of the model's objective",
    ("--step", "dit/checkpoint/posthoc.py"): "a step that has a snapshot",
    ("--token-drop", "dit/model/config.py"): "path-drop guidance needs a token-drop model",
    ("--precision", "dit/train/config.py"): "the launcher's precision against the run's",
}


def bounded_flags(root: Path = ROOT) -> set[str]:
    """The flags of every section field under ``root``/dit that carries a bound."""
    flags = set()
    for path in (root / "dit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call)):
                continue
            name = getattr(node.value.func, "id", getattr(node.value.func, "attr", ""))
            if name in ("option", "_flag") and BOUNDS & {k.arg for k in node.value.keywords}:
                flags.add("--" + node.target.id.replace("_", "-"))
    return flags


def repeated_checks(root: Path = ROOT) -> list[tuple[str, str, int, str]]:
    """(flag, module, line, text) of every ``raise`` under ``root``/dit that re-checks a bounded flag."""
    flags, found = bounded_flags(root), []
    for path in sorted((root / "dit").rglob("*.py")):
        module = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and node.exc is not None):
                continue
            text = "".join(
                c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
            for flag in sorted(flags):
                match = re.search(re.escape(flag) + r"(?![\w-])", text)
                if match and WORDING.search(text[match.end() : match.end() + 60]):
                    found.append((flag, module, node.lineno, text))
    return found


def test_the_scanner_finds_a_repeat_and_passes_a_cross_field_check(tmp_path):
    """The shape of the checks this change removed (dit-cost memory's --num-gpus, checked in the command)."""
    (tmp_path / "dit").mkdir()
    (tmp_path / "dit" / "args.py").write_text(
        "class A(Section):\n    num_gpus: int = option(1, 'devices', ge=1)\n"
    )
    (tmp_path / "dit" / "cmd.py").write_text(
        "def cmd(n, b):\n"
        "    if b % n:\n        raise UserError(f'--global-batch-size {b} does not split over --num-gpus {n}.')\n"
        "    if n < 1:\n        raise UserError(f'--num-gpus must be >= 1, got {n}.')\n"
    )
    assert [hit[:3] for hit in repeated_checks(tmp_path)] == [("--num-gpus", "dit/cmd.py", 5)]


def test_no_check_is_repeated_beyond_the_known_list():
    found = {(flag, module) for flag, module, _, _ in repeated_checks()}
    new = sorted(found - ALLOWED.keys())
    assert not new, f"a bounded flag checked again downstream (drop the copy, or list it with why): {new}"
    stale = sorted(ALLOWED.keys() - found)
    assert not stale, f"no longer found: remove from ALLOWED {stale}"


if __name__ == "__main__":
    for flag, module, line, text in repeated_checks():
        print(f"{module}:{line}  {flag}: {text[:90]}")
