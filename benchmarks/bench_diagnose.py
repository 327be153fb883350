"""`creditrl diagnose`'s sampling cost per group, before and after batching, side by side on the same
prompts and the same model (default: the smollm2-addition config, SmolLM2-135M on 2 threads).

- before: one ``generate`` call per prompt for its M groups (the prompt repeated M times, so
  prefilled M times), as diagnose sampled until issue 33;
- after: one ``generate`` call for the whole round (each prompt once, its cache shared by its M·N
  rows), as ``creditrl.tools.diagnose.measure.ModelSource.sample`` does.

    python benchmarks/bench_diagnose.py [--config smollm2-addition] [--prompts 24] [--groups 2] [key=value ...]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from creditrl.config import load_config
from creditrl.recipe.build import build_task, default_max_new_tokens, load_configured_policy
from creditrl.recipe.resolve import resolve_config, resolve_device
from creditrl.runtime.rollout import generate_rollouts
from creditrl.utils.threads import torch_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config", default="smollm2-addition")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--groups", type=int, default=2, help="groups per prompt (diagnose.groups_per_prompt)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cfg = resolve_config(load_config(args.config, args.overrides))
    task = build_task(cfg)
    with torch_threads(cfg.train.threads):
        threads = torch.get_num_threads()
        model, tokenizer = load_configured_policy(cfg, task, resolve_device(cfg.train.device), progress=False)
        model.eval()
        r = cfg.rollout
        rollout = {"temperature": r.temperature, "top_p": r.top_p, "max_tool_tokens": r.max_tool_tokens,
                   "max_new_tokens": r.max_new_tokens or default_max_new_tokens(task, tokenizer),
                   "stop_strings": tuple(r.stop)}
        rng = random.Random(0)
        problems = [task.sample(rng) for _ in range(args.prompts)]
        n, m = r.group_size, args.groups
        generate_rollouts(model, tokenizer, task, problems[:1], group_size=n, **rollout)       # warm-up
        rows = []
        for repeat in range(args.repeats):
            start = time.perf_counter()
            tokens = 0
            for problem in problems:
                batch = generate_rollouts(model, tokenizer, task, [problem] * m, group_size=n,
                                          generator=torch.Generator().manual_seed(repeat), **rollout)
                tokens += batch.num_tokens
            before = time.perf_counter() - start
            start = time.perf_counter()
            batch = generate_rollouts(model, tokenizer, task, problems, group_size=m * n,
                                      generator=torch.Generator().manual_seed(repeat), **rollout)
            after = time.perf_counter() - start
            rows.append((before, after, tokens, batch.num_tokens))
    groups = args.prompts * m
    print(f"{cfg.model.name}, {args.prompts} prompts x {m} groups x N={n} ({groups} groups), up to "
          f"{rollout['max_new_tokens']} new tokens, {threads} threads")
    print("repeat | before s/group | after s/group | ratio | tokens before / after")
    for i, (before, after, t_before, t_after) in enumerate(rows):
        print(f"{i} | {before / groups:.3f} | {after / groups:.3f} | {before / after:.2f}x | {t_before} / {t_after}")


if __name__ == "__main__":
    main()
