"""Report helpers shared by the tools (``creditrl compare``, ``creditrl diagnose``) and the research
experiments: CSV/JSON in and out, figures without pyplot, Markdown tables.

Every report writes its numbers to CSV/JSON first and builds its figure and its Markdown from
them, so a report is always regenerated from data, never typed.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from creditrl.utils.plots import figure, save_figure

__all__ = ["Row", "figure", "fmt", "group_rows", "markdown_table", "pivot_table", "read_csv", "read_json",
           "save_figure", "write_csv", "write_json"]


Row = dict[str, object]


def write_csv(path: Path, rows: Sequence[Row]) -> Path:
    """Write ``rows`` to ``path``; floats keep full precision. The columns are every row's keys in the order
    first seen; a row without one leaves its cell empty (a metric one run measured and another did not)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise ValueError(f"rows: expected at least one row for {path}, got none")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def _parse(value: str) -> object:
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number


def read_csv(path: Path) -> list[Row]:
    """Rows of a CSV written by ``write_csv``, numbers parsed back to int/float; an empty cell (a key that row
    did not have) is left out of the row."""
    with Path(path).open(newline="") as f:
        return [{key: _parse(value) for key, value in row.items() if value != ""} for row in csv.DictReader(f)]


def write_json(path: Path, obj: object) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    return path


def read_json(path: Path) -> object:
    return json.loads(Path(path).read_text())


def group_rows(rows: Iterable[Row], key: str) -> dict[object, list[Row]]:
    """Rows bucketed by ``row[key]``, keeping first-seen order."""
    out: dict[object, list[Row]] = {}
    for row in rows:
        out.setdefault(row[key], []).append(row)
    return out


def fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "undefined"      # e.g. an efficiency whose reference gradient was not resolved
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(rows: Sequence[Row], columns: Sequence[str] | None = None, digits: int = 3) -> str:
    """A GitHub Markdown table of ``rows`` (all columns unless ``columns`` is given); a '|' inside a
    cell (e.g. |entropy change|) is escaped, or it would split the cell."""
    if not rows:
        return "_(no rows)_\n"
    columns = list(columns or rows[0])

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(str(c)) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(fmt(row.get(c, ""), digits)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pivot_table(rows: Sequence[Row], index: str, column: str, value: str, digits: int = 3) -> str:
    """Markdown table with one row per ``index`` value and one column per ``column`` value."""
    columns = list(group_rows(rows, column))
    table = [{index: key, **{m[column]: m[value] for m in members}} for key, members in group_rows(rows, index).items()]
    return markdown_table(table, [index] + columns, digits)
