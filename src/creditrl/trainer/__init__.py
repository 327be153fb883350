"""The creditrl RL trainer: the loop (loop.py) over rollouts (``creditrl.runtime``) and updates
(update.py), checkpoints (checkpoint.py), run directories (rundir.py), run outputs (logging.py,
report.py).

``train(cfg) -> run_dir``, ``resume(run_dir) -> run_dir``.
"""
from creditrl.trainer.loop import Trainer, resume, train

__all__ = ["Trainer", "resume", "train"]
