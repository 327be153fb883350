"""``train.precision=auto`` resolved when a run starts: the run's own model, task and sampler
timed at fp32 and at bf16 autocast on a probe shaped like its steps (decoding, then one
forward+backward of the decoded batch), and the faster kept where bf16's gradient agrees with
fp32's (``runtime.precision.choose_precision`` holds the rule). On a CPU whose bf16 matrix
product is hopelessly slow (``runtime.precision.matmul_precheck``), fp32 without timing the model.
The choice and both timings go to the run's config.yaml (as a comment above the resolved
``train.precision``) and summary.
"""
from __future__ import annotations

import dataclasses
import random

import torch

from creditrl.config import Config
from creditrl.recipe.resolve import precision_of
from creditrl.runtime.precision import PrecisionChoice, choose_precision, matmul_precheck, model_probe, probing
from creditrl.runtime.rollout import generate_rollouts
from creditrl.runtime.scoring import response_stats

PROBE_ROWS = 4       # responses of one prompt
PROBE_TOKENS = 8     # decoding steps (fewer when rollout.max_new_tokens is smaller)


def resolve_precision(cfg: Config, model, tokenizer, task) -> tuple[Config, PrecisionChoice | None]:
    """``cfg`` with ``train.precision`` resolved (unchanged unless ``auto``) and the choice made,
    None when there was none to make. builtin:tiny runs fp32 untimed (``precision_of``); weights stored
    in bf16 compute in bf16 whatever the autocast, so they record bf16 untimed."""
    if cfg.train.precision != "auto":
        return cfg, None
    if cfg.model.dtype == "bfloat16":          # the weights compute in bf16 whatever the autocast
        choice = PrecisionChoice("bf16", {}, None, f"the model's weights are stored in {cfg.model.dtype} "
                                 f"(model.dtype), so the model computes in {cfg.model.dtype} whatever the autocast")
    elif precision_of(cfg).resolved:           # a model auto does not time (UNTIMED_MODELS)
        choice = PrecisionChoice(precision_of(cfg).name, {}, None, f"{cfg.model.name}'s millisecond steps time "
                                                                   "too noisily to choose by, and fp32 is exact")
    else:
        cpu = next(model.parameters()).device.type == "cpu"
        choice = (matmul_precheck() if cpu else None) or measure_precision(cfg, model, tokenizer, task)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=choice.chosen)), choice


def measure_precision(cfg: Config, model, tokenizer, task) -> PrecisionChoice:
    """Time the run's model at fp32 and bf16 on one prompt's group (``PROBE_ROWS`` responses,
    ``PROBE_TOKENS`` decoding steps, then a forward+backward of the policy-gradient surrogate on
    one fixed decoded batch). The trainer's task stream, generator and torch's RNG are untouched."""
    r = cfg.rollout
    rows, steps = min(r.group_size, PROBE_ROWS), min(PROBE_TOKENS, r.max_new_tokens or PROBE_TOKENS)
    problems = [task.sample(random.Random(cfg.train.seed))]
    device = next(model.parameters()).device

    def decode():
        return generate_rollouts(model, tokenizer, task, problems, group_size=rows, temperature=r.temperature,
                                 top_p=r.top_p, max_new_tokens=steps, max_tool_tokens=r.max_tool_tokens,
                                 generator=torch.Generator().manual_seed(cfg.train.seed), stop_strings=tuple(r.stop))

    with probing(model):
        batch = decode()
        inputs = {k: getattr(batch, k).to(device) for k in ("input_ids", "attention_mask", "position_ids",
                                                             "response_mask", "group")}
        mask = inputs["response_mask"][:, batch.prompt_len:]

        def forward_backward():
            model.train()
            stats = response_stats(model, inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"],
                                   inputs["response_mask"], batch.prompt_len, temperature=r.temperature,
                                   chunk_size=cfg.train.chunk_size, group=inputs["group"])
            return -(stats.logp * mask).sum() / mask.sum().clamp(min=1)

        return choose_precision(model_probe(model, decode, forward_backward),
                                probe=f"a probe of {rows} responses x {steps} decoding steps + forward/backward")
