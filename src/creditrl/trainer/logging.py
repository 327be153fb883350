"""Run outputs while training: JSONL per step, TensorBoard when installed, a rich progress bar.

On resume the JSONL files are cut back to the checkpoint's step first, so a run killed
after logging steps the checkpoint does not cover re-logs them exactly once.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

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


def _clean(value):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLogger:
    """``log(name, record)`` appends to ``<name>.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, progress: bool = True, total_steps: int = 0,
                 start_step: int = 0):
        self.run_dir = run_dir
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is optional
                self.writer = None
        self.progress = None
        if progress:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                     TextColumn("{task.fields[headline]}"), transient=False)
            self.progress.start()
            self.bar = self.progress.add_task("train", total=total_steps, completed=start_step, headline="")

    def log(self, name: str, record: dict) -> None:
        record = {k: _clean(v) for k, v in record.items()}
        with open(self.run_dir / f"{name}.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{name}/{key}", value, step)
        if self.progress is not None and name == "metrics":
            headline = "  ".join(f"{k}={record[k]:.3g}" for k in HEADLINE if record.get(k) is not None)
            self.progress.update(self.bar, completed=record["step"], headline=headline)

    def log_completions(self, step: int, kind: str, samples: list[dict]) -> None:
        """Append samples to ``completions.jsonl`` (with ``step`` and ``kind``: train/eval) and
        show them as a Markdown table in TensorBoard's text tab."""
        if not samples:
            return
        with open(self.run_dir / "completions.jsonl", "a") as fh:
            for sample in samples:
                fh.write(json.dumps({"step": step, "kind": kind, **sample}) + "\n")
        if self.writer is not None:
            def cell(text) -> str:
                return str(text).replace("|", "\\|").replace("\n", "\\n")
            rows = ["| prompt | completion | reward | advantage | length | stopped |", "|---|---|---|---|---|---|"]
            rows += [f"| {cell(x['prompt'][-200:])} | {cell(x['completion'])} | {x['reward']:.3g} | "
                     f"{'' if x['advantage'] is None else format(x['advantage'], '.3g')} | {x['length']} | "
                     f"{x['stopped']} |" for x in samples]
            self.writer.add_text(f"completions/{kind}", "\n".join(rows), step)

    def message(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.progress is not None:
            self.progress.stop()
