"""Figures without pyplot: ``matplotlib.figure.Figure`` draws and saves a PNG with no global backend
or figure registry touched, so a library user's notebook keeps its inline plots. matplotlib is an
extra (``creditrl[plots]``); ``require_matplotlib`` names it before any work."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path


def require_matplotlib(key: str) -> None:
    """Raise ImportError naming ``key`` and the extra when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"{key}: drawing plots needs matplotlib, which is not installed: pip install "
                          f"'creditrl[plots]', or set {key}=false")


def figure(ncols: int = 1, nrows: int = 1, *, width: float = 4.2, height: float = 3.2):
    """A matplotlib ``Figure`` and its axes, without pyplot: no global backend or figure registry is
    touched (safe in tests, on servers and inside a user's notebook). matplotlib (the ``plots``
    extra) is imported here, so nothing loads it until a figure is drawn."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows))
    return fig, fig.subplots(nrows, ncols, squeeze=False).ravel()


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Save a small PNG (dpi 100)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path


def plain_log_ticks(axis) -> None:
    """A log axis labelled in plain numbers (0.8, 2, 10) rather than 8×10⁻¹: every major tick, and the
    minor ticks at 2 and 5 of each decade (every minor tick but 9·10ᵏ while the axis spans less than a
    decade: 9 sits a log-step of 0.05 below the next major tick, and their labels overlap)."""
    from matplotlib.ticker import FuncFormatter

    def minor(value: float, _) -> str:
        low, high = sorted(axis.get_view_interval())
        narrow = low > 0 and high / low < 10
        lead = round(value / 10 ** math.floor(math.log10(value)), 6) if value > 0 else 0
        return f"{value:g}" if value > 0 and (narrow and lead != 9 or lead in (2, 5)) else ""
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def step_axis(ax) -> None:
    """Label ``ax``'s x axis "step" with whole-number ticks only: a run of a few steps would
    otherwise be ticked at 0.5, 1.5 (steps are counts)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
