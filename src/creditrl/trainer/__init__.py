"""The creditrl RL trainer: rollout (rollout.py), update (update.py), loop (loop.py),
checkpoints (checkpoint.py), run outputs (logging.py, report.py), held-out eval (evaluation.py).

``train(cfg) -> run_dir``, ``resume(run_dir) -> run_dir``, ``evaluate(model, tokenizer, task, ...)``.
"""
from creditrl.trainer.evaluation import evaluate
from creditrl.trainer.loop import Trainer, resume, train
from creditrl.trainer.rollout import RolloutBatch, generate_rollouts

__all__ = ["RolloutBatch", "Trainer", "evaluate", "generate_rollouts", "resume", "train"]
