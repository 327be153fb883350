"""``creditrl eval RUN_OR_MODEL [--n N] [--k K ...] [--problems P]``: held-out greedy accuracy and
unbiased pass@k / avg@k of a run's ``final/`` (with its config.yaml), a model directory, or any
model the config keys name. Prints JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from creditrl.config import apply_overrides, eval_settings, load_config, load_saved_config
from creditrl.recipe import reference
from creditrl.recipe.build import build_task, default_max_new_tokens, load_configured_policy
from creditrl.recipe.resolve import precision_of, resolve_config, resolve_device
from creditrl.runtime.evaluation import evaluate
from creditrl.trainer.checkpoint import list_checkpoints
from creditrl.trainer.loop import final_problem
from creditrl.trainer.precision import resolve_precision
from creditrl.utils import cli
from creditrl.utils.rundir import RUN_MARKER, check_writable, run_kind

HELP = "held-out greedy accuracy and pass@k / avg@k"


def main(argv: list[str]) -> int:
    parser = cli.config_parser("eval", HELP, "Evaluate a run's final model (`creditrl eval runs/NAME`, or --run DIR), "
                               "a model directory (`creditrl eval path/to/model`) or any model given by config keys "
                               "(model.name, task.name, ...). Prints JSON: greedy_acc (one greedy response per "
                               "prompt); sampled_acc (the mean accuracy of all n samples); pass@k, the unbiased "
                               "estimate 1 - C(n-c,k)/C(n,k) from all n samples per prompt (Chen et al. 2021), so "
                               "pass@1 = sampled_acc; avg@k, the mean accuracy of the first k samples of each prompt, "
                               "so avg@1 reads one sample per prompt and differs from pass@1 by sampling noise "
                               "(avg@n = sampled_acc). Values rounded to 12 decimals.", reference.epilog())
    parser.usage = "creditrl eval [RUN_OR_MODEL] [key=value ...] [options]"
    parser.add_argument("--run", metavar="DIR", help="a finished run: DIR/config.yaml and the model in DIR/final")
    parser.add_argument("--n", type=int, help="samples per prompt (default train.eval_samples)")
    parser.add_argument("--k", type=int, nargs="+", help="k values for pass@k/avg@k (default train.pass_k)")
    parser.add_argument("--problems", type=int, help="held-out prompts used (default train.eval_problems)")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE")
    args = cli.parse(parser, argv, paths=True)    # RUN_OR_MODEL may come after the options
    return cli.run("eval", lambda: run(args))


def eval_target(args) -> tuple[Path | None, list[str]]:
    """(the run or model directory given as the positional RUN_OR_MODEL or --run, the key=value
    overrides); at most one directory."""
    targets = [item for item in args.overrides if "=" not in item]
    overrides = [item for item in args.overrides if "=" in item]
    if len(targets) + bool(args.run) > 1:
        raise ValueError(f"RUN_OR_MODEL: expected one run or model directory (positional or --run), got "
                         f"{targets + ([args.run] if args.run else [])}")
    target = args.run or (targets[0] if targets else None)
    if target is None:
        return None, overrides
    path = Path(target).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"RUN_OR_MODEL: {target!r} is not a directory; expected a creditrl run directory "
                                f"(config.yaml + final/) or a model directory (or no positional argument and "
                                f"model.name=...)")
    if args.run and not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"--run: {target!r} has no config.yaml; expected a creditrl run directory")
    return path, overrides


# the keys an evaluation reads: the model and how it loads, the task, sampling, the eval sizes and seed
# (rollout.group_size: train.precision=auto times a rollout of that many responses)
EVAL_KEYS = ("model.", "task.", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens", "rollout.group_size",
             "rollout.max_tool_tokens", "rollout.stop", "train.seed", "train.device", "train.precision",
             "train.threads", "train.chunk_size", "train.eval_samples", "train.eval_problems", "train.pass_k",
             "train.deterministic")
# ... less those of building builtin:tiny and of training, where the weights come from a directory
BUILT_KEYS = ("model.tiny.", "model.warm_start.", "model.lora.", "model.gradient_checkpointing")


def check_eval_overrides(overrides: list[str], directory: bool) -> None:
    """Refuse ``key=value`` overrides an evaluation never reads (training's keys; the tiny model's
    shape, warm start and LoRA settings where ``directory`` gives the weights): the result's
    ``settings.overrides`` would list them as what produced its numbers."""
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    idle = [k for k in keys if not k.startswith(EVAL_KEYS) or directory and k.startswith(BUILT_KEYS)]
    if idle:
        built = ", or how a model is built: the weights come from the directory" if directory else ""
        raise ValueError(f"{idle[0]}: creditrl eval does not read {', '.join(idle)} (training settings{built}); "
                         f"drop {'it' if len(idle) == 1 else 'them'}")


def eval_config(args):
    """(config, model directory or None) of ``creditrl eval``'s arguments: a run directory's saved
    config and its complete ``final/``, a model directory as ``model.name``, or the config keys."""
    path, overrides = eval_target(args)
    check_eval_overrides(overrides, path is not None)
    if path is not None and path.name == "final" and not (path / "config.yaml").is_file() and \
            (path.parent / "config.yaml").is_file():
        path = path.parent            # a run's final/: evaluated as the run, with its task and settings
    if path is not None and any(o.split("=", 1)[0].strip() == "model.name" for o in overrides):
        raise ValueError(f"model.name: given twice, as the directory {str(path)!r} and as model.name=...; drop one")
    if path is not None and not (path / "config.yaml").is_file() and run_kind(path) == "train":
        raise FileNotFoundError(f"RUN_OR_MODEL: {str(path)!r} is a creditrl training run (its {RUN_MARKER} marker) "
                                f"but has no config.yaml, which evaluating a run needs; restore it, or evaluate "
                                f"its model directory ({str(path / 'final')!r})")
    if path is None or not (path / "config.yaml").is_file():
        named = [f"model.name={path}"] if path is not None else []
        return resolve_config(load_config(args.config, [*overrides, *named])), None
    final = path / "final"
    if not final.is_dir():
        found = list_checkpoints(path)
        raise FileNotFoundError(f"RUN_OR_MODEL: {str(final)!r} not found: the run has not finished"
                                + (f" (its newest checkpoint is {found[-1].name}; `creditrl train --resume {path}` "
                                   f"finishes it)" if found else ""))
    problem = final_problem(final)
    if problem:
        raise ValueError(f"RUN_OR_MODEL: {str(final)!r} is damaged: {problem}")
    if args.config:
        raise ValueError("--config: a run directory is evaluated with its own config.yaml; drop --config (key=value "
                         "overrides still apply)")
    # the task keeps the format of the run's model.name (a LoRA final/ is an adapter on the same base)
    return resolve_config(apply_overrides(load_saved_config(path / "config.yaml"), overrides)), str(final)


def eval_sizes(args, cfg, task) -> tuple[int, list[int], list]:
    """(samples per problem, ks, problems) of ``creditrl eval``: its flags checked against the
    config and the held-out set before the model loads."""
    limit, samples, ks = eval_settings(cfg)
    n = samples if args.n is None else args.n
    if n < 1:
        raise ValueError(f"--n: expected a positive number of samples per problem, got {n}")
    ks = args.k if args.k is not None else [k for k in ks if k <= n]
    bad = [k for k in ks if not 1 <= k <= n]
    if bad or len(set(ks)) != len(ks):
        raise ValueError(f"--k: expected distinct values in [1, n={n}] (n: --n or train.eval_samples), got {ks}")
    held_out = task.test_set()
    wanted = args.problems if args.problems is not None else limit
    if args.problems is not None and not 1 <= args.problems <= len(held_out):
        raise ValueError(f"--problems: expected a value in [1, {len(held_out)}] (the task's held-out set has "
                         f"{len(held_out)} problems), got {args.problems}")
    return n, ks, held_out[:wanted] if wanted else held_out


def run(args) -> int:
    cfg, weights = eval_config(args)
    task = build_task(cfg)
    n, ks, problems = eval_sizes(args, cfg, task)
    if args.out:
        if Path(args.out).expanduser().is_dir():
            raise IsADirectoryError(f"--out: expected a file path for the JSON result, got the directory {args.out!r}")
        check_writable(Path(args.out).expanduser().resolve().parent, "--out")
    model, tokenizer = load_configured_policy(cfg, task, resolve_device(cfg.train.device), not args.no_progress,
                                              name=weights)
    cfg, choice = resolve_precision(cfg, model, tokenizer, task)     # auto: timed on this model
    if choice is not None:
        print(f"note: {choice.text()}", file=sys.stderr)
    r = cfg.rollout
    with precision_of(cfg).autocast(model):
        result = evaluate(model, tokenizer, task, problems, n=n, ks=ks, temperature=r.temperature, top_p=r.top_p,
                          max_new_tokens=r.max_new_tokens or default_max_new_tokens(task, tokenizer),
                          max_tool_tokens=r.max_tool_tokens, seed=cfg.train.seed, stop_strings=tuple(r.stop))
    settings = {"task_options": dict(cfg.task.options), "temperature": r.temperature, "top_p": r.top_p,
                "max_new_tokens": r.max_new_tokens or default_max_new_tokens(task, tokenizer), "seed": cfg.train.seed,
                "precision": cfg.train.precision, "overrides": eval_target(args)[1]}   # what produced these numbers
    text = json.dumps({"model": weights or cfg.model.name, "task": cfg.task.name, **result, "settings": settings},
                      indent=2, default=str)
    print(text)
    if args.out:
        out = Path(args.out).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0
