"""The creditrl RL trainer: the loop (loop.py) over rollouts (``creditrl.runtime``) and updates
(update.py), checkpoints (checkpoint.py), run directories (rundir.py), run outputs (logging.py,
report.py).

``train(cfg) -> run_dir``, ``resume(run_dir) -> run_dir``.
"""
import importlib

__all__ = ["Trainer", "resume", "train"]


def __getattr__(name: str):
    """The loop's names, loaded on first use (PEP 562): ``creditrl train`` (``trainer/command.py``,
    inside this package) checks its arguments and config before torch and transformers load."""
    if name in __all__:
        return getattr(importlib.import_module("creditrl.trainer.loop"), name)
    raise AttributeError(f"module 'creditrl.trainer' has no attribute {name!r}")
