"""Run by tests/test_trl_multiprocess.py in two CPU processes (accelerate, gloo). Each group of
4 completions spans both processes (2 per process), so rewards, masks and energies must be gathered.

    python trl_two_process.py MODEL_DIR OUT_DIR ESTIMATOR

Trains CreditGRPOTrainer for 2 steps and writes, per process, every generation batch's
``last_rollout`` tensors and the creditrl metrics this process computed, plus (main process)
TRL's log history, to OUT_DIR/rank<r>.pt.
"""
from __future__ import annotations

import sys

import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from creditrl.integrations.trl import CreditGRPOConfig, CreditGRPOTrainer

NUM_GENERATIONS = 4


def count_digits(completions, **kwargs):
    return [float(sum(c.isdigit() for c in text)) for text in completions]


def main(model_dir: str, out_dir: str, estimator: str) -> None:
    state = PartialState()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": ["ab", "cd", "12", "ef", "34", "gh", "a1", "b2"] * 2})
    args = CreditGRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=NUM_GENERATIONS // 2, num_generations=NUM_GENERATIONS,
        max_completion_length=8, max_steps=2, learning_rate=5e-2, logging_steps=1, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", seed=0, temperature=1.0, advantage_estimator=estimator,
        estimator_options={"k": 2} if estimator == "maxpo" else None, log_energy_metrics=True)
    trainer = CreditGRPOTrainer(model=model, reward_funcs=count_digits, args=args, train_dataset=dataset,
                                processing_class=tokenizer)
    rollouts, local_metrics = [], []
    compute_loss, log = trainer._compute_loss, trainer._log_creditrl

    def recording_loss(model, inputs):  # one loss call per generation (steps_per_generation=1);
        loss = compute_loss(model, inputs)  # last_rollout is complete after it (otb: set in the loss)
        rollouts.append({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                         for k, v in trainer.last_rollout.items()})
        return loss

    def recording_log(mode, metrics):
        local_metrics.append((mode, dict(metrics)))
        return log(mode, metrics)

    trainer._compute_loss = recording_loss
    trainer._log_creditrl = recording_log
    trainer.train()
    torch.save({"rank": state.process_index, "world": state.num_processes, "rollouts": rollouts,
                "metrics": local_metrics, "log_history": trainer.state.log_history},
               f"{out_dir}/rank{state.process_index}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
