"""Each check once, where the value is born: a flag whose field carries a bound (``ge``, ``gt``, ``le``, ``lt``,
``choices``) is refused by its section, so no ``raise`` elsewhere in dit/ tests it again.

What this finds: a ``raise`` whose literal text names a bounded flag and either words a bound after it
(within 60 characters: "must be", "positive", ">= 1", "in (0, 1]", "one of") or sits under an ``if`` that
tests a breach of that flag's bound (``x < 1`` for ``ge=1``, ``x not in CHOICES`` for ``choices=CHOICES``).
A check of another kind names its own rule ("two respaced steps on one timestep", "a sampler of this
objective"), not the bound. What it misses: a check whose flag name arrives in a variable, and a repeat
worded otherwise under a test of another shape. ``python tests/test_checks_once.py`` lists the repeats.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = {"ge", "gt", "le", "lt", "choices"}
WORDING = re.compile(r"must be|positive|>= ?\d|> ?0\b|<= ?1\b|in \(0, 1\]|one of")
# The comparison that breaches each bound, and what ``not`` makes of each comparison.
BREACH = {"ge": ast.Lt, "gt": ast.LtE, "le": ast.Gt, "lt": ast.GtE}
NEGATED = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.In: ast.NotIn}
NEGATED |= {v: k for k, v in NEGATED.items()}
FLIPPED = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}


def bounded_flags(root: Path = ROOT) -> dict[str, list[dict[str, ast.expr]]]:
    """Each flag of a section field under ``root``/dit that carries a bound, with the bounds' expressions of
    each field that spells it."""
    flags = {}
    for path in (root / "dit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call)):
                continue
            name = getattr(node.value.func, "id", getattr(node.value.func, "attr", ""))
            bounds = {k.arg: k.value for k in node.value.keywords if k.arg in BOUNDS}
            if name in ("option", "_flag") and bounds:
                flags.setdefault("--" + node.target.id.replace("_", "-"), []).append(bounds)
    return flags


def _literal(node: ast.expr):
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None
    return frozenset(value) if isinstance(value, (tuple, list, set)) else value


def _same_choices(node: ast.expr, choices: ast.expr) -> bool:
    """``node`` is the field's choices: the same name (``PRECISIONS``, ``peaks.PRECISIONS``) or the same values."""
    tail = lambda n: n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)  # noqa: E731
    same_name = tail(node) is not None and tail(node) == tail(choices)
    return same_name or (_literal(node) is not None and _literal(node) == _literal(choices))


def _breaches(test: ast.expr, bounds: dict[str, ast.expr], negated: bool = False) -> bool:
    """Whether ``test`` (an ``if``'s condition, true when the ``raise`` runs) holds a breach of ``bounds``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _breaches(test.operand, bounds, not negated)
    if isinstance(test, ast.BoolOp):
        return any(_breaches(v, bounds, negated) for v in test.values)
    if not isinstance(test, ast.Compare):
        return False
    operands = [test.left, *test.comparators]
    for left, op, right in zip(operands, test.ops, operands[1:]):
        op = NEGATED.get(type(op), type(op)) if negated else type(op)
        if op is ast.NotIn and "choices" in bounds and _same_choices(right, bounds["choices"]):
            return True
        if isinstance(left, ast.Constant) and op in FLIPPED:  # 1 > x reads x < 1
            left, op, right = right, FLIPPED[op], left
        value = _literal(right)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if any(op is BREACH[k] and _literal(bounds[k]) == value for k in BREACH if k in bounds):
                return True
    return False


def _raises(tree: ast.AST, tests: tuple = ()):
    """Every ``raise`` under ``tree`` with the conditions of the ``if``s it sits in."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Raise) and child.exc is not None:
            yield child, tests
        inner = (*tests, child.test) if isinstance(child, ast.If) else tests
        yield from _raises(child, inner)


def repeated_checks(root: Path = ROOT) -> list[tuple[str, str, int, str]]:
    """(flag, module, line, text) of every ``raise`` under ``root``/dit that re-checks a bounded flag."""
    flags, found = bounded_flags(root), []
    for path in sorted((root / "dit").rglob("*.py")):
        module = path.relative_to(root).as_posix()
        for node, tests in _raises(ast.parse(path.read_text())):
            text = "".join(
                c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
            for flag, fields in sorted(flags.items()):
                match = re.search(re.escape(flag) + r"(?![\w-])", text)
                worded = match and WORDING.search(text[match.end() : match.end() + 60])
                if match and (worded or any(_breaches(t, bounds) for t in tests for bounds in fields)):
                    found.append((flag, module, node.lineno, text))
    return found


def _tree(tmp_path, checks: str) -> Path:
    (tmp_path / "dit").mkdir()
    (tmp_path / "dit" / "args.py").write_text(
        "class A(Section):\n"
        "    num_gpus: int = option(1, 'devices', ge=1)\n"
        "    mode: str = option('a', 'mode', choices=MODES)\n"
        "    scale: float = option(4.0, 'scale', ge=1)\n"
    )
    (tmp_path / "dit" / "cmd.py").write_text(checks)
    return tmp_path


def test_the_scanner_finds_a_repeat_and_passes_a_cross_field_check(tmp_path):
    """The shape of the checks this change removed (dit-cost memory's --num-gpus, checked in the command)."""
    root = _tree(
        tmp_path,
        "def cmd(n, b):\n"
        "    if b % n:\n        raise UserError(f'--global-batch-size {b} does not split over --num-gpus {n}.')\n"
        "    if n < 1:\n        raise UserError(f'--num-gpus must be >= 1, got {n}.')\n",
    )
    assert [hit[:3] for hit in repeated_checks(root)] == [("--num-gpus", "dit/cmd.py", 5)]


def test_the_scanner_finds_a_repeat_worded_otherwise_by_its_test(tmp_path):
    """A breach of the bound under the ``if`` (either side, under ``not``, or a choices test), whatever the
    words; a test of another rule on the same flag passes."""
    root = _tree(
        tmp_path,
        "def cmd(n, m, s, cls, model):\n"
        "    if not n >= 1:\n        raise UserError(f'--num-gpus {n} is too few.')\n"
        "    if 1 > n:\n        raise UserError(f'--num-gpus {n} is too few.')\n"
        "    if m not in config.MODES:\n        raise UserError(f'--mode {m} is unknown.')\n"
        "    if m not in cls.modes:\n        raise UserError(f'--mode {m} does not fit this model.')\n"
        "    if s > 1 and not model.null_class:\n        raise UserError('nothing to guide: pass --scale 1.')\n",
    )
    assert [hit[:3] for hit in repeated_checks(root)] == [
        ("--num-gpus", "dit/cmd.py", 3), ("--num-gpus", "dit/cmd.py", 5), ("--mode", "dit/cmd.py", 7)
    ]  # fmt: skip


def test_no_check_is_repeated():
    found = [f"{module}:{line} {flag}: {text[:80]}" for flag, module, line, text in repeated_checks()]
    assert not found, "a bounded flag checked again downstream (drop the copy):\n" + "\n".join(found)


if __name__ == "__main__":
    for flag, module, line, text in repeated_checks():
        print(f"{module}:{line}  {flag}: {text[:90]}")
