"""GRPO in TRL on reasoning-gym problems, scored by a plain TRL reward function, with creditrl's estimators.

Offline on CPU with creditrl's tiny Llama (a character tokenizer with a ChatML chat template):

    python examples/trl_reasoning_gym.py --output_dir runs/trl_rg --dataset basic_arithmetic --max_steps 20

or any local chat model: ``--model_name_or_path /path/to/model``. The dataset is TRL's conversational
format (a ``prompt`` column of messages: reasoning-gym's answer-format system prompt, then the
question) plus an ``index`` column; ``reasoning_gym_reward`` is an ordinary TRL reward function
(``prompts``, ``completions`` and every other dataset column as keyword arguments, one float per
completion) that scores with reasoning-gym's own ``score_answer``. The same function works unchanged
as ``task.options.checker`` of ``creditrl train`` on a JSONL/Parquet file with those columns.
Every ``CreditGRPOConfig`` / ``GRPOConfig`` field is a flag (``--advantage_estimator otb``, ...).
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass, field

import reasoning_gym
from datasets import Dataset
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from creditrl.integrations.trl import CreditGRPOConfig, CreditGRPOTrainer
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Local chat model; default: tiny Llama."})
    dataset: str = field(default="basic_arithmetic", metadata={"help": "A reasoning-gym dataset name."})
    dataset_config: str = field(default="{}", metadata={"help": "Its options as JSON, e.g. '{\"max_terms\": 2}'."})
    system_prompt: str = field(default="direct", metadata={"help": "A key of reasoning_gym.utils.SYSTEM_PROMPTS."})
    num_prompts: int = 512


def make_reward(data):
    """A TRL reward function scoring with ``data``'s ``score_answer`` (``index``: the dataset column)."""
    def reasoning_gym_reward(prompts, completions, index, **kwargs) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(data.score_answer(extract_answer(t), data[i])) for t, i in zip(texts, index)]
    return reasoning_gym_reward


def build_dataset(script: ScriptArguments, seed: int):
    """(TRL dataset with ``prompt`` and ``index`` columns, the reasoning-gym dataset behind it)."""
    data = reasoning_gym.create_dataset(script.dataset, seed=seed, size=script.num_prompts,
                                        **json.loads(script.dataset_config))
    system = SYSTEM_PROMPTS[script.system_prompt]
    rows = [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": data[i]["question"]}],
             "index": i} for i in range(len(data))]
    return Dataset.from_list(rows), data


def load_model(path: str | None):
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tokenizer = char_tokenizer(string.printable, model_max_length=1024)
    tokenizer.chat_template = CHATML
    shape = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                            max_position_embeddings=1024)
    return tiny_model(tokenizer, shape), tokenizer


def main(argv: list[str] | None = None) -> CreditGRPOTrainer:
    script, config = HfArgumentParser((ScriptArguments, CreditGRPOConfig)).parse_args_into_dataclasses(argv)
    dataset, data = build_dataset(script, config.seed)
    model, tokenizer = load_model(script.model_name_or_path)
    trainer = CreditGRPOTrainer(model=model, reward_funcs=make_reward(data), args=config, train_dataset=dataset,
                                processing_class=tokenizer)
    trainer.train()
    trainer.save_model(config.output_dir)
    return trainer


if __name__ == "__main__":
    main()
