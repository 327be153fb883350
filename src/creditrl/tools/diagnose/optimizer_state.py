"""Adam's v̂ from a training run's newest checkpoint (``diagnose.optimizer_state=RUN_DIR``): AdamW's
exp_avg_sq of each measured parameter, bias-corrected by 1 − β₂^step. The run must have trained this
model: its model settings are checked before the model loads, its trainable parameters' names and
shapes once it has (both before any sampling)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from creditrl.config import Config, read_saved_config
from creditrl.runtime.gradient_space import GradientSpace
from creditrl.trainer.checkpoint import list_checkpoints, load_latest

KEY = "diagnose.optimizer_state"


def check_run(run_dir: str, cfg: Config) -> Path:
    """Before the model loads: ``run_dir`` is a creditrl run with a checkpoint, and trained the
    configured model (the same ``model.name``, or this config's model is a directory inside it, e.g.
    its final/), with the same tiny-model and LoRA settings."""
    path = Path(run_dir).expanduser()
    if not (path / "config.yaml").is_file() or not list_checkpoints(path):
        raise ValueError(f"{KEY}: expected a creditrl training run directory with config.yaml and a checkpoint "
                         f"(checkpoints/step_*), got {str(path)!r}")
    saved = read_saved_config(path / "config.yaml")["model"]
    ours = cfg.model
    inside = Path(ours.name).expanduser().resolve().is_relative_to(path.resolve())
    if saved["name"] != ours.name and not inside:
        raise ValueError(f"{KEY}: the run at {str(path)!r} trained model.name={saved['name']!r}, but this config "
                         f"diagnoses model.name={ours.name!r}; expected the same model (or a directory of that run)")
    for section in ("tiny", "lora"):
        mine = getattr(ours, section).__dict__
        if ours.name == "builtin:tiny" or section == "lora":
            differ = sorted(k for k, v in saved.get(section, {}).items() if mine.get(k, v) != v)
            if differ:
                raise ValueError(f"{KEY}: the run at {str(path)!r} trained a model with other model.{section} "
                                 f"settings ({', '.join(f'{k}={saved[section][k]!r}' for k in differ)}); expected "
                                 f"this config's")
    return path


def from_checkpoint(run_dir: Path, model, space: GradientSpace) -> list[Tensor]:
    """v̂ of each measured parameter from the run's newest checkpoint; refused (naming the first
    difference) when its trainable parameters are not this model's."""
    weights, state = load_latest(run_dir)
    optimizer = state.get("optimizer")
    if not optimizer:
        raise ValueError(f"{KEY}: the run at {str(run_dir)!r} saved no optimizer state (train.save_optimizer=false)")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    theirs = {k: tuple(v.shape) for k, v in weights.items()}
    if set(theirs) != {n for n, _ in named} or any(theirs[n] != tuple(p.shape) for n, p in named):
        first = next((n for n, p in named if theirs.get(n) != tuple(p.shape)), sorted(set(theirs) - dict(named).keys()))
        raise ValueError(f"{KEY}: the run at {str(run_dir)!r} trained a different model: its trainable parameters "
                         f"differ from this model's (first difference: {first!r}, {len(theirs)} vs {len(named)} "
                         f"tensors)")
    beta2 = optimizer["param_groups"][0]["betas"][1]
    slots = optimizer["state"]
    wanted = {id(p) for p in space.params}
    out = []
    for i, (_, p) in enumerate(named):
        if id(p) in wanted:
            slot = slots.get(i)
            steps = float(slot["step"]) if slot is not None else 0.0
            v = slot["exp_avg_sq"] / (1 - beta2 ** steps) if slot is not None and steps > 0 else torch.zeros_like(p)
            out.append(v.to(device=p.device, dtype=torch.float64))
    return out
