"""What a resumed run may change in its config.yaml, and the check of an edited one."""
from __future__ import annotations

from pathlib import Path

from creditrl.config.files import flatten, saved_layout
from creditrl.config.schema import ConfigError

# what a resumed run may change (by editing its config.yaml; output_dir / run_name follow a run
# directory that was moved); every other key is fixed for the run's life: the model, LoRA, task,
# sampling, estimator, loss, seed, precision and the eval set define it
RESUME_CHANGEABLE = ("optim.lr", "optim.weight_decay", "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio",
                     "optim.max_grad_norm", "train.steps", "train.eval_every", "train.save_every", "train.keep_last",
                     "train.save_optimizer", "train.output_dir", "train.run_name", "logging.*")


def changeable_on_resume(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUME_CHANGEABLE)


def resume_changes(before: dict, after: dict, step: int) -> dict[str, list]:
    """``{key: [before, after]}`` for each key of the resolved configs ``before`` (what the run
    trained with up to ``step``) and ``after`` (its edited config.yaml) that differs. A change of a
    key not in ``RESUME_CHANGEABLE``, or ``train.steps`` below ``step``, is a ConfigError naming
    every such key with both values."""
    old, new = flatten(saved_layout(before)), flatten(after)
    if "loss.max_len" in old and old["loss.max_len"] is None:   # saved before an unset max_len was recorded as
        old["loss.max_len"] = old.get("rollout.max_new_tokens")  # the budget it trained with
    absent = "<absent>"
    changes = {k: [old.get(k, absent), new.get(k, absent)] for k in sorted(set(old) | set(new))
               if old.get(k, absent) != new.get(k, absent)}
    fixed = {k: v for k, v in changes.items() if not changeable_on_resume(k)}
    if fixed:
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in fixed.items())
        raise ConfigError(f"config.yaml: {len(fixed)} key(s) changed that cannot change in the middle of a run "
                          f"({shown}). Restore them, or start a new run with them; a resumed run may change only "
                          f"{', '.join(RESUME_CHANGEABLE)}")
    steps = new.get("train.steps")
    if isinstance(steps, int) and steps < step:
        raise ConfigError(f"train.steps: the run has already trained {step} steps; expected a value >= {step}, got "
                          f"{steps}")
    return changes


def run_place(output_dir: str, run_name: str | None) -> Path:
    """The run directory that ``train.output_dir`` / ``train.run_name`` name, resolved."""
    return (Path(output_dir).expanduser() / (run_name or "")).resolve()


def check_location_edit(output_dir: str, run_name: str | None, before: dict, run_dir: Path) -> None:
    """A resumed run continues in its own directory ``run_dir``: config.yaml's ``train.output_dir`` /
    ``train.run_name`` may name it, or the place the run was trained in (``before``, the checkpoint's
    config: a moved or copied run), and then follow it. Naming a third place is an edit that cannot
    take effect, refused naming both keys."""
    old = flatten(saved_layout(before))
    trained = (old.get("train.output_dir"), old.get("train.run_name"))
    said = run_place(output_dir, run_name)
    if said == run_dir.resolve() or (trained[0] is not None and said == run_place(*trained)):
        return
    raise ConfigError(f"config.yaml: train.output_dir {output_dir!r} / train.run_name {run_name!r} name {str(said)!r}, "
                      f"but this run is in {str(run_dir)!r}: a resumed run continues in its own directory. To move "
                      f"the run, move its directory and resume it there (config.yaml then follows); otherwise restore "
                      f"train.output_dir {trained[0]!r} and train.run_name {trained[1]!r}")
