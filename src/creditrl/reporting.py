"""Report helpers shared by ``creditrl compare`` and the experiments: CSV/JSON in and out,
figures, Markdown tables, bootstrap CIs (one lower module both import).

Every experiment writes its numbers to CSV first and builds its figure and its Markdown
section from those CSVs, so ``docs/results.md`` is always regenerated from data, never typed.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor


Row = dict[str, object]


def write_csv(path: Path, rows: Sequence[Row]) -> Path:
    """Write ``rows`` (dicts with the same keys) to ``path``; floats keep full precision."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise ValueError(f"rows: expected at least one row for {path}, got none")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
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
    """Rows of a CSV written by ``write_csv``, numbers parsed back to int/float."""
    with Path(path).open(newline="") as f:
        return [{key: _parse(value) for key, value in row.items()} for row in csv.DictReader(f)]


def write_json(path: Path, obj: object) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    return path


def read_json(path: Path) -> object:
    return json.loads(Path(path).read_text())


def figure(ncols: int = 1, nrows: int = 1, *, width: float = 4.2, height: float = 3.2):
    """A matplotlib figure on the non-interactive backend (safe in tests and on servers)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes.ravel()


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Save small PNGs (dpi 100) and close the figure so long sweeps do not leak memory."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def group_rows(rows: Iterable[Row], key: str) -> dict[object, list[Row]]:
    """Rows bucketed by ``row[key]``, keeping first-seen order."""
    out: dict[object, list[Row]] = {}
    for row in rows:
        out.setdefault(row[key], []).append(row)
    return out


def fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(rows: Sequence[Row], columns: Sequence[str] | None = None, digits: int = 3) -> str:
    """A GitHub Markdown table of ``rows`` (all columns unless ``columns`` is given)."""
    if not rows:
        return "_(no rows)_\n"
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, ""), digits) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pivot_table(rows: Sequence[Row], index: str, column: str, value: str, digits: int = 3) -> str:
    """Markdown table with one row per ``index`` value and one column per ``column`` value."""
    columns = list(group_rows(rows, column))
    table = [{index: key, **{m[column]: m[value] for m in members}} for key, members in group_rows(rows, index).items()]
    return markdown_table(table, [index] + columns, digits)


def mean_se(x: Tensor) -> tuple[float, float]:
    """Mean and standard error over dim 0 of a 1-D sample (SE 0 for a single value)."""
    x = x.double().flatten()
    se = float(x.std(unbiased=True) / math.sqrt(x.numel())) if x.numel() > 1 else 0.0
    return float(x.mean()), se


def bootstrap_ci(statistic: Callable[[Tensor], Tensor], n: int, *, n_boot: int = 1000, level: float = 0.95,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Percentile bootstrap CI of ``statistic(idx)`` over resamples of ``n`` units.

    ``statistic`` maps a [R, n] index tensor (R resamples of unit indices) to [R, ...];
    returns (low, high) with shape [...]. Vectorised: one call evaluates every resample.
    """
    idx = torch.randint(0, n, (n_boot, n), generator=generator)
    values = statistic(idx).double()
    alpha = (1.0 - level) / 2
    q = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)
    low, high = torch.nanquantile(values, q, dim=0)  # resamples with a 0/0 ratio are dropped
    return low, high


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (e.g. -0.5 for an M^-1/2 decay)."""
    lx = torch.log(torch.tensor(x, dtype=torch.float64))
    ly = torch.log(torch.tensor(y, dtype=torch.float64))
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / (lx * lx).sum())


OUTCOMES = ("reproduces", "partly", "does not reproduce", "inconclusive")


def verdict_line(claim: str, outcome: str, why: str) -> str:
    """One Markdown line: the claim, its outcome (one of ``OUTCOMES``), and why.

    'inconclusive': the setting did not produce the condition the claim is about, or the
    interval covers both outcomes — never counted as agreement or as contradiction."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome: expected one of {OUTCOMES}, got {outcome!r}")
    return f"**{claim}: {outcome}.** {why}\n"
