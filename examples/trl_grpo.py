"""Train with creditrl's estimators and losses inside TRL's GRPOTrainer.

Runs offline on CPU with creditrl's tiny Llama and the addition task (a few minutes):

    python examples/trl_grpo.py --output_dir runs/trl_otb --advantage_estimator otb --max_steps 20

Every ``CreditGRPOConfig`` / ``GRPOConfig`` field is a flag (e.g. ``--advantage_estimator maxpo
--estimator_options '{"k": 4}'``, ``--stapo true``, ``--trace_lam 0.99``, ``--loss_type dr_grpo``,
``--loss_terms '[{"path": "my_terms:length_penalty", "coef": 0.01}]'``). Scale out as with
any TRL script: ``accelerate launch --num_processes 8 examples/trl_grpo.py --model_name_or_path
Qwen/Qwen2.5-1.5B --use_vllm true --vllm_importance_sampling_correction false --rollout_correction tis``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from creditrl.integrations.trl import CreditGRPOConfig, CreditGRPOTrainer
from creditrl.runtime.models.tiny import char_tokenizer, tiny_model
from creditrl.tasks import get_task


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "HF model; default: creditrl's tiny Llama."})
    task: str = field(default="addition", metadata={"help": "A creditrl task (creditrl.tasks.list_tasks())."})
    num_prompts: int = 512


def main() -> None:
    script, config = HfArgumentParser((ScriptArguments, CreditGRPOConfig)).parse_args_into_dataclasses()
    task = get_task(script.task, seed=config.seed)
    rng = random.Random(config.seed)
    problems = [task.sample(rng) for _ in range(script.num_prompts)]
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    by_prompt = {p.prompt: p for p in problems}

    def task_reward(prompts, completions, **kwargs):
        return [task.reward(by_prompt[p], c) for p, c in zip(prompts, completions)]

    if script.model_name_or_path is None:
        tokenizer = char_tokenizer(task.alphabet())
        model = tiny_model(tokenizer)
    else:
        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    trainer = CreditGRPOTrainer(model=model, reward_funcs=task_reward, args=config, train_dataset=dataset,
                                processing_class=tokenizer)
    trainer.train()
    trainer.save_model(config.output_dir)


if __name__ == "__main__":
    main()
