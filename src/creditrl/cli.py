"""``creditrl train | eval | compare | diagnose | estimators | config | experiment``.

Config values are set with ``--config FILE`` (YAML) and positional dotted ``key=value``
overrides, e.g. ``creditrl train algorithm.estimator=maxpo algorithm.options.k=4 train.steps=100``.
Set CREDITRL_DEBUG=1 to see full tracebacks instead of one-line errors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from creditrl import reference
from creditrl.config import ConfigError, apply_overrides, eval_settings, load_config, load_saved_config
from creditrl.core.estimators import list_estimators
from creditrl.core.estimators.registry import get_estimator
from creditrl.runtime.evaluation import evaluate
from creditrl.runtime.setup import (build_task, default_max_new_tokens, load_configured_policy, resolve_config,
                                    resolve_device)
from creditrl.studies import compare
from creditrl.studies import experiments
from creditrl.studies.diagnose import run_command
from creditrl.trainer import resume, train
from creditrl.trainer.checkpoint import list_checkpoints
from creditrl.trainer.loop import TrainingStopped, final_problem
from creditrl.trainer.rundir import check_writable
from creditrl.trainer.update import autocast
from creditrl.utils.imports import PluginError

SUBCOMMANDS = {  # subcommands that parse their own arguments: name -> (main(argv) -> int, help)
    "compare": (compare.main, "run several configs x seeds and write one comparison report"),
    "experiment": (experiments.main, "run the papers' experiments and write docs/results.md"),
}
EXAMPLES = """examples:
  creditrl train
  creditrl train algorithm.estimator=maxpo algorithm.options.k=4 train.steps=100
  creditrl train --config my.yaml model.name=/path/to/hf-model task.name=jsonl task.options.path=data.jsonl
  creditrl train --resume runs/addition-otb-s0-20250101-120000
  creditrl config > docs/config.md"""


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--config", metavar="FILE", help="YAML config file (or a packaged config's name)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in CI logs)")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="creditrl", description="Critic-free RL post-training of LLMs "
                                     "(OTB, MaxPO, STAPO, GRPO-λ) that runs on a CPU.", formatter_class=raw)
    sub = parser.add_subparsers(dest="command", metavar="{train,eval,diagnose,compare,estimators,config,experiment}")
    epilog = "config keys (key=value; defaults shown; null = automatic/off):\n" + "\n".join(reference.help_lines())
    train_p = sub.add_parser("train", help="train a policy (defaults: builtin:tiny on addition)", formatter_class=raw,
                             description="Train with the default config, a YAML file and/or key=value overrides.",
                             epilog=epilog + "\n\n" + EXAMPLES)
    _config_args(train_p)
    train_p.add_argument("--resume", metavar="DIR", help="continue the interrupted run in DIR exactly (its "
                         "config.yaml and newest checkpoint; no other options allowed)")
    train_p.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same "
                         "train.run_name and start again (without it an existing run is refused)")
    eval_p = sub.add_parser("eval", help="held-out greedy accuracy and pass@k / avg@k", formatter_class=raw,
                            usage="creditrl eval [RUN_OR_MODEL] [key=value ...] [options]",
                            description="Evaluate a run's final model (`creditrl eval runs/NAME`, or --run DIR), a "
                            "model directory (`creditrl eval path/to/model`) or any model given by config keys "
                            "(model.name, task.name, ...). Prints JSON.", epilog=epilog)
    _config_args(eval_p)
    eval_p.add_argument("--run", metavar="DIR", help="a finished run: DIR/config.yaml and the model in DIR/final")
    eval_p.add_argument("--n", type=int, help="samples per prompt (default train.eval_samples)")
    eval_p.add_argument("--k", type=int, nargs="+", help="k values for pass@k/avg@k (default train.pass_k)")
    eval_p.add_argument("--problems", type=int, help="held-out prompts used (default train.eval_problems)")
    eval_p.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE")
    diag_p = sub.add_parser("diagnose", help="measure which estimator gives the best gradient on this model/task",
                            formatter_class=raw, epilog=epilog,
                            description="Sample diagnose.prompts prompts x diagnose.groups_per_prompt groups with the "
                            "configured policy and compare every estimator's exact gradient at matched signal; "
                            "writes diagnose.md/.json/.png to a run directory. Same config as `train` plus diagnose.*.")
    _config_args(diag_p)
    diag_p.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same "
                        "diagnose.run_name and start again (without it an existing one is refused)")
    sub.add_parser("estimators", help="list the registered advantage estimators and their options",
                   description="Every registered advantage estimator with its description and options.")
    sub.add_parser("config", help="print the configuration reference (Markdown; docs/config.md)",
                   description="Every config key, estimator option, loss-term option and task option.")
    for name, (_, text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def cmd_train(args) -> int:
    start = time.perf_counter()
    if args.resume:
        if args.config or args.overrides or args.overwrite:
            raise ValueError("--resume: a resumed run uses its saved config.yaml; drop --config, --overwrite and "
                             "key=value (to change a key that may change mid-run, such as optim.lr or train.steps, "
                             "edit DIR/config.yaml)")
        run_dir = resume(args.resume, progress=not args.no_progress)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = train(cfg, progress=False if args.no_progress else None, overwrite=args.overwrite)
    print((run_dir / "summary.md").read_text())
    print(f"run directory: {run_dir}  (total wall time incl. model load/warm start: "
          f"{(time.perf_counter() - start) / 60:.1f} min)")
    return 0


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


def eval_config(args):
    """(config, model directory or None) of ``creditrl eval``'s arguments: a run directory's saved
    config and its complete ``final/``, a model directory as ``model.name``, or the config keys."""
    path, overrides = eval_target(args)
    if path is not None and any(o.split("=", 1)[0].strip() == "model.name" for o in overrides):
        raise ValueError(f"model.name: given twice, as the directory {str(path)!r} and as model.name=...; drop one")
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


def cmd_eval(args) -> int:
    cfg, weights = eval_config(args)
    task = build_task(cfg)
    n, ks, problems = eval_sizes(args, cfg, task)
    if args.out:
        check_writable(Path(args.out).expanduser().resolve().parent, "--out")
    model, tokenizer = load_configured_policy(cfg, task, resolve_device(cfg.train.device), not args.no_progress,
                                              name=weights)
    r = cfg.rollout
    with autocast(model, cfg.train.precision):
        result = evaluate(model, tokenizer, task, problems, n=n, ks=ks, temperature=r.temperature, top_p=r.top_p,
                          max_new_tokens=r.max_new_tokens or default_max_new_tokens(task, tokenizer),
                          max_tool_tokens=r.max_tool_tokens, seed=cfg.train.seed, stop_strings=tuple(r.stop))
    text = json.dumps({"model": weights or cfg.model.name, "task": cfg.task.name, **result}, indent=2)
    print(text)
    if args.out:
        Path(args.out).expanduser().write_text(text + "\n")
    return 0


def cmd_diagnose(args) -> int:
    cfg = load_config(args.config, args.overrides)
    run_dir = run_command(cfg, overwrite=args.overwrite, progress=not args.no_progress)
    print((run_dir / "diagnose.md").read_text())
    return 0


def cmd_estimators(args) -> int:
    table = Table("estimator", "needs energy", "options (default)", "description")
    for name in list_estimators():
        spec = get_estimator(name)
        options = ", ".join(f"{s.name}={'required' if s.required else s.default}" for s in spec.option_specs or [])
        table.add_row(name, "yes" if spec.needs_energy else "", options, spec.doc)
    Console(width=200).print(table)
    return 0


def cmd_config(args) -> int:
    sys.stdout.write(reference.markdown())
    return 0


HANDLERS = {"train": cmd_train, "eval": cmd_eval, "diagnose": cmd_diagnose, "estimators": cmd_estimators,
            "config": cmd_config}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:  # they parse their own options (and --help)
        return int(SUBCOMMANDS[argv[0]][0](argv[1:]) or 0)
    parser = build_parser()
    # key=value may come before or after options (argparse ends a subcommand's positionals at the first option)
    args, extra = parser.parse_known_args(argv)
    if extra:
        positional = args.command == "eval"        # eval's RUN_OR_MODEL may come after its options
        if not hasattr(args, "overrides") or any(item.startswith("-") or ("=" not in item and not positional)
                                                 for item in extra):
            parser.parse_args(argv)  # exits with argparse's own message
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return HANDLERS[args.command](args)
    except (ConfigError, ImportError, OSError, PluginError, TrainingStopped, ValueError) as err:
        if os.environ.get("CREDITRL_DEBUG"):
            raise
        print(f"creditrl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
