"""docs/architecture.md's section table against the sections: each row's module holds the sections it names,
with the field counts it gives (a row "one per ..." gives the range over every section of its module)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from dit.io.config import Section

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def table_rows() -> list[list[str]]:
    lines = DOC.read_text().splitlines()
    start = lines.index("| section | module (owner) | fields | read by | faces |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def sections_of(module) -> dict[str, type]:
    return {
        name: c
        for name, c in vars(module).items()
        if inspect.isclass(c) and issubclass(c, Section) and c.__module__.startswith(module.__name__)
    }


def field_count(cls: type) -> int:
    return len(dataclasses.fields(cls))


def test_the_table_has_rows():
    assert len(table_rows()) >= 15


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: r[0][:40])
def test_a_row_gives_its_sections_field_counts(row):
    names_cell, module_cell, counts_cell = row[:3]
    path = re.search(r"`(dit/[\w/]*?)(?:\.py)?/?`", module_cell).group(1)
    module = importlib.import_module(path.replace("/", "."))
    found = sections_of(module)
    names = re.findall(r"`(\w+)`", names_cell)
    for name in names:
        assert name in found, f"{path} defines no section {name}"
    if "one per" in names_cell:
        counts = sorted(field_count(c) for c in found.values())
        low, high = (int(x) for x in counts_cell.split("-"))
        assert (low, high) == (counts[0], counts[-1]), f"{names_cell}: fields {counts[0]}-{counts[-1]}"
        return
    given = [int(x) for x in counts_cell.split(",")]
    assert len(given) == len(names), f"{names_cell}: one count per section"
    assert given == [field_count(found[n]) for n in names], f"{names_cell}: the sections' field counts"
