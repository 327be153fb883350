"""Atomic, lean checkpoints holding everything exact resume needs.

A checkpoint is a directory ``checkpoints/step_000040/`` with
- ``weights.safetensors``: the *trainable* parameters in the model's own dtype (all weights
  for full fine-tuning, tied weights once; only the adapters for LoRA);
- ``state.pt``: optimizer (unless ``train.save_optimizer=false``) and scheduler states, the
  step and token counters, and every RNG the run draws from (torch global + the trainer's
  generator, python ``random``, numpy, the task stream);
- ``manifest.json``: size and SHA-256 of both files, written last.
It is written into a temporary directory and renamed into place, so a crash mid-write leaves
only a ``.tmp-*`` directory, never a partial checkpoint. ``load_latest`` verifies the manifest
and falls back to the newest valid checkpoint with a warning (a file truncated or damaged
later, e.g. by a full disk or a copy); only when none is valid does resume fail, saying why.
A failed write (disk full, permissions) removes its temporary directory and names the path.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from creditrl.utils.io import MANIFEST as MANIFEST  # noqa: F401 - a checkpoint's file names in one place
from creditrl.utils.io import atomic_directory, manifest_problem, write_manifest

PATTERN = re.compile(r"step_(\d+)$")
WEIGHTS, STATE = "weights.safetensors", "state.pt"


def verify(path: Path) -> None:
    """Raise ValueError saying what is wrong with checkpoint directory ``path``."""
    problem = manifest_problem(path, required=(WEIGHTS, STATE))
    if problem:
        raise ValueError(problem)


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
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def trainable_state(model) -> dict:
    """The trainable parameters by name (detached; tied weights appear once)."""
    return {name: p.detach().contiguous() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model, weights: dict) -> None:
    """Load ``trainable_state`` output back; every trainable parameter must be present."""
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:5], sorted(set(weights) - expected)[:5]
        raise ValueError(f"checkpoint: its weights do not match the model's trainable parameters "
                         f"(missing {missing}, unexpected {extra}); was it written with another model.* config?")
    model.load_state_dict(weights, strict=False)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in folder.glob("step_*") if (m := PATTERN.search(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: str | Path, step: int, weights: dict, state: dict, keep_last: int) -> Path:
    """Write ``checkpoints/step_{step}/`` atomically; keep the newest ``keep_last``."""
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}"
    try:   # replace: an older run's checkpoint of the same step (resume after a crash)
        with atomic_directory(path, replace=True) as tmp:
            save_file({k: v.cpu() for k, v in weights.items()}, tmp / WEIGHTS)
            atomic_save({**state, "step": step}, tmp / STATE)
            write_manifest(tmp, step=step)
    except OSError as err:
        raise OSError(f"checkpoint: could not write {str(path)!r}: {err.strerror or err} (nothing partial was "
                      f"left behind)") from err
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_latest(run_dir: str | Path, skipped: list[str] | None = None) -> tuple[dict, dict]:
    """``(weights, state)`` of the newest complete checkpoint of ``run_dir``; a clear error when there is none.
    Damaged newer checkpoints are skipped: each is appended to ``skipped`` ("step_N: what is wrong")
    when a list is given (the trainer prints and records them), else a warning names them."""
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"resume: no checkpoint in {str(Path(run_dir) / 'checkpoints')!r}; "
                                f"expected step_* directories written by a creditrl train run")
    problems = []
    for path in reversed(found):
        try:
            verify(path)
            loaded = load_file(path / WEIGHTS), torch.load(path / STATE, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - any damage means: try the next older one
            problems.append(f"{path.name}: {err}")
            continue
        if problems and skipped is not None:
            skipped.extend(problems)
        elif problems:
            warnings.warn(f"resume: skipped damaged checkpoint(s) ({'; '.join(problems)}); resuming from "
                          f"{path.name}", stacklevel=2)
        return loaded
    raise ValueError(f"resume: no valid checkpoint in {str(Path(run_dir) / 'checkpoints')!r}: {'; '.join(problems)}")
