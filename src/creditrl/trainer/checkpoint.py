"""Atomic checkpoints (temp file + rename) holding everything exact resume needs.

A checkpoint is one ``torch.save`` file ``checkpoints/step_000040.pt`` with the model,
optimizer and scheduler states, the step and token counters, and every RNG the run draws
from (torch global + the trainer's generator, python ``random``, numpy, the task stream).
A crash mid-write leaves only a ``.tmp`` file, never a truncated checkpoint.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

PATTERN = re.compile(r"step_(\d+)\.pt$")


def rng_state(generator: torch.Generator, task_rng: random.Random) -> dict:
    return {"torch": torch.get_rng_state(), "generator": generator.get_state(), "python": random.getstate(),
            "numpy": np.random.get_state(), "task": task_rng.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict, generator: torch.Generator, task_rng: random.Random) -> None:
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    task_rng.setstate(state["task"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in folder.glob("step_*.pt") if (m := PATTERN.search(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: str | Path, step: int, state: dict, keep_last: int) -> Path:
    """Write ``state`` as ``checkpoints/step_{step}.pt`` atomically; keep the newest ``keep_last``."""
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.pt"
    atomic_save({**state, "step": step}, path)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_latest(run_dir: str | Path) -> dict:
    """The newest complete checkpoint of ``run_dir``; a clear error when there is none."""
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"resume: no checkpoint in {str(Path(run_dir) / 'checkpoints')!r}; "
                                f"expected files step_*.pt written by a creditrl train run")
    return torch.load(found[-1], map_location="cpu", weights_only=False)
