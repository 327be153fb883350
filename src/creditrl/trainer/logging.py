"""Run outputs while training: JSONL per step (always), the trackers of ``logging.report_to``
(TensorBoard, trackio, wandb: ``trainer/trackers.py``), a rich progress bar.

On resume the JSONL files are cut back to the checkpoint's step first, so a run killed
after logging steps the checkpoint does not cover re-logs them exactly once; each tracker is then
rebuilt from them (``replay``), so its history equals the JSONL files'.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from creditrl.trainer.trackers import TRACKER_CLASSES, check_trackers
from creditrl.utils.io import atomic_write_text

HEADLINE = ("reward_mean", "accuracy", "entropy", "response_len")


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Keep only the records with ``step <= last_step`` (and drop a torn last line)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    with open(path) as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            if record.get("step", 0) <= last_step:
                keep.append(line if line.endswith("\n") else line + "\n")
    atomic_write_text(path, "".join(keep))   # a crash here leaves the old file, never a cut one


def replay(tracker, run_dir: Path) -> None:
    """Send a run's records so far (metrics, evals, completion tables) to a fresh ``tracker``."""
    for name in ("metrics", "eval"):
        for record in read_jsonl(run_dir / f"{name}.jsonl"):
            tracker.log(name, record, record["step"])
    tables: dict[tuple[int, str], list[dict]] = {}
    for record in read_jsonl(run_dir / "completions.jsonl"):
        sample = {k: v for k, v in record.items() if k not in ("step", "kind")}
        tables.setdefault((record["step"], record["kind"]), []).append(sample)
    for (step, kind), samples in tables.items():
        tracker.log_table(f"completions/{kind}", samples, step)


def _clean(value):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLogger:
    """``log(name, record)`` appends to ``<name>.jsonl`` and sends the scalars to each tracker;
    ``log_completions`` and ``log_images`` send samples and plots to them as well."""

    def __init__(self, run_dir: Path, *, report_to: list[str] = ("jsonl",), config: dict | None = None,
                 progress: bool = True, total_steps: int = 0, start_step: int = 0):
        self.run_dir = run_dir
        self.trackers, self.progress = [], None
        try:
            for name in check_trackers(list(report_to)):   # one failing closes those already open
                tracker_class = TRACKER_CLASSES[name]
                shutil.rmtree(run_dir / tracker_class.folder, ignore_errors=True)   # rebuilt from the JSONL
                try:
                    tracker = tracker_class(run_dir, config or {}, start_step)
                except Exception as err:   # e.g. wandb without a login, a full disk: named with its key
                    raise OSError(f"logging.report_to: tracker {name!r} could not start: {type(err).__name__}: "
                                  f"{err}; fix it or drop {name!r} from logging.report_to") from err
                self.trackers.append(tracker)
                if tracker.replays:
                    replay(tracker, run_dir)
        except BaseException:
            self.close()
            raise
        if progress:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                     TextColumn("{task.fields[headline]}"), transient=False)
            self.progress.start()
            self.bar = self.progress.add_task("train", total=total_steps, completed=start_step, headline="")

    def log(self, name: str, record: dict) -> None:
        record = {k: _clean(v) for k, v in record.items()}
        with open(self.run_dir / f"{name}.jsonl", "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
        for tracker in self.trackers:
            tracker.log(name, record, record["step"])
        if self.progress is not None and name == "metrics":
            headline = "  ".join(f"{k}={record[k]:.3g}" for k in HEADLINE if record.get(k) is not None)
            self.progress.update(self.bar, completed=record["step"], headline=headline)

    def log_completions(self, step: int, kind: str, samples: list[dict]) -> None:
        """Append samples to ``completions.jsonl`` (with ``step`` and ``kind``: train/eval) and
        send them to each tracker as a table ``completions/<kind>``."""
        if not samples:
            return
        with open(self.run_dir / "completions.jsonl", "a") as fh:
            for sample in samples:
                fh.write(json.dumps({"step": step, "kind": kind, **sample}, default=str) + "\n")
        for tracker in self.trackers:
            tracker.log_table(f"completions/{kind}", samples, step)

    def log_images(self, paths: list[Path], step: int) -> None:
        """Send the run's plots (PNG files) to each tracker."""
        for tracker in self.trackers:
            tracker.log_images(paths, step)

    def message(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.progress is not None:
            self.progress.stop()
