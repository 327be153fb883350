"""Experiment trackers of ``logging.report_to``: TensorBoard, trackio and wandb, beside the JSONL files.

Each tracker gets the run's config at the start, then every metrics and eval record (scalars
``metrics/<key>`` and ``eval/<key>`` at their step), the completion samples as a table
(``completions/train`` / ``completions/eval``) and the plots at the end (``plots/<name>``).
Each keeps its data inside the run directory:

- ``tensorboard``: event files in ``<run>/tensorboard`` (the config and the tables as text);
- ``trackio``: its SQLite database and media in ``<run>/trackio`` (project ``creditrl``, run named
  after the run directory; ``trackio show --project creditrl`` with ``TRACKIO_DIR=<run>/trackio``);
- ``wandb``: ``<run>/wandb/``, offline unless ``WANDB_MODE`` says otherwise (then
  ``wandb sync <run>/wandb/offline-run-*`` uploads it); project ``$WANDB_PROJECT`` or ``creditrl``.

The JSONL files are the run's record. Whenever a run starts or resumes, each tracker's folder is
emptied and its history rebuilt from them (``RunLogger``), so after a kill and ``--resume`` a
tracker holds exactly the steps of metrics.jsonl: none lost with the killed process, none twice.
wandb's online mode keeps its history on the server: a resumed online run rewinds it to the
checkpoint's step (wandb's ``resume_from``) instead.

A tracker's package is an extra (``pip install 'creditrl[trackio]'``); ``check_trackers`` names
the missing or broken one before any work starts.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from creditrl.config import TRACKERS

PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}
PROJECT = "creditrl"


def check_trackers(report_to: list[str]) -> list[str]:
    """The trackers to open besides JSONL (always on), each checked to be known and installed."""
    chosen = []
    for name in dict.fromkeys(report_to):
        if name not in TRACKERS:
            raise ValueError(f"logging.report_to: unknown tracker {name!r}; valid trackers are {list(TRACKERS)}")
        if name == "jsonl":
            continue
        try:
            importlib.import_module(PACKAGES[name])
        except Exception as err:   # missing, or installed but failing to import
            raise ImportError(f"logging.report_to: {name!r} needs the {PACKAGES[name]} package, which cannot be "
                              f"imported ({type(err).__name__}: {err}): pip install 'creditrl[{name}]', or drop "
                              f"{name!r} from logging.report_to") from None
        chosen.append(name)
    return chosen


def table_rows(samples: list[dict]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of completion samples; nested values (difficulty, extras) as JSON text."""
    columns = list(dict.fromkeys(k for s in samples for k in s))
    def cell(value):
        return json.dumps(value, default=str) if isinstance(value, (dict, list, tuple)) else value
    return columns, [[cell(s.get(c)) for c in columns] for s in samples]


def _scalars(name: str, record: dict) -> dict[str, float]:
    return {f"{name}/{k}": v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardTracker:
    folder, replays = "tensorboard", True

    def __init__(self, run_dir: Path, config: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / self.folder))
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log(self, name: str, record: dict, step: int) -> None:
        for key, value in _scalars(name, record).items():
            self.writer.add_scalar(key, value, step)

    def log_table(self, name: str, samples: list[dict], step: int) -> None:
        columns, rows = table_rows(samples)
        def cell(text) -> str:
            return str(text)[-200:].replace("|", "\\|").replace("\n", "\\n")
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell("" if v is None else v) for v in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def log_images(self, paths: list[Path], step: int) -> None:
        import matplotlib.image   # plots exist only with matplotlib (the plots extra)

        for path in paths:
            self.writer.add_image(f"plots/{path.stem}", matplotlib.image.imread(path)[..., :3], step,
                                  dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


def _point_trackio_at(folder: Path) -> None:
    """trackio reads ``TRACKIO_DIR`` once, at import, into module constants; point them (and the
    variable) at this run's folder, so each run in a process gets its own database."""
    os.environ["TRACKIO_DIR"] = str(folder)
    paths = {"TRACKIO_DIR": folder, "MEDIA_DIR": folder / "media", "ARTIFACTS_DIR": folder / "artifacts"}
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "trackio" or name.startswith("trackio.")):
            for attr, value in paths.items():
                if hasattr(module, attr):
                    setattr(module, attr, value)


class _RunTracker:
    """trackio and wandb share one API: ``run.log(dict, step)``, ``lib.Table``, ``lib.Image``."""
    lib: Any
    run: Any

    def log(self, name: str, record: dict, step: int) -> None:
        self.run.log(_scalars(name, record), step=step)

    def log_table(self, name: str, samples: list[dict], step: int) -> None:
        columns, rows = table_rows(samples)
        self.run.log({name: self.lib.Table(columns=columns, data=rows)}, step=step)

    def log_images(self, paths: list[Path], step: int) -> None:
        self.run.log({f"plots/{p.stem}": self.lib.Image(str(p)) for p in paths}, step=step)


class TrackioTracker(_RunTracker):
    folder, replays = "trackio", True

    def __init__(self, run_dir: Path, config: dict, start_step: int):
        self._old_dir = os.environ.get("TRACKIO_DIR")
        _point_trackio_at(run_dir / "trackio")
        import trackio

        _point_trackio_at(run_dir / "trackio")
        self.lib = trackio
        with contextlib.redirect_stdout(io.StringIO()):   # trackio prints dashboard instructions
            self.run = trackio.init(project=PROJECT, name=run_dir.name, config=config, resume="allow",
                                    embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()
        if self.lib.context_vars.current_run.get() is self.run:   # else trackio finishes it again at exit
            self.lib.context_vars.current_run.set(None)
        if self._old_dir is None:
            os.environ.pop("TRACKIO_DIR", None)
        else:
            os.environ["TRACKIO_DIR"] = self._old_dir


class WandbTracker(_RunTracker):
    folder = "wandb"

    def __init__(self, run_dir: Path, config: dict, start_step: int):
        import wandb

        self.lib = wandb
        run_id = f"{run_dir.name[:40]}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        mode = None if os.environ.get("WANDB_MODE") else "offline"
        self.replays = mode == "offline" or os.environ.get("WANDB_MODE") in ("offline", "dryrun", "disabled")
        # online, the history lives on the server: rewind it to the checkpoint (no replay)
        where = ({"resume_from": f"{run_id}?_step={start_step}"} if start_step and not self.replays
                 else {"id": run_id, "resume": "allow"})
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_dir.name, **where,
                              dir=str(run_dir), mode=mode, config=config,
                              settings=wandb.Settings(console="off", silent=True, reinit="create_new",
                                                      x_disable_stats=True))

    def close(self) -> None:
        self.run.finish()


TRACKER_CLASSES = {"tensorboard": TensorBoardTracker, "trackio": TrackioTracker, "wandb": WandbTracker}

