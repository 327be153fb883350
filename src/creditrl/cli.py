"""``creditrl train | eval | compare | estimators | experiment``.

Config values are set with ``--config FILE`` (YAML) and positional dotted ``key=value``
overrides, e.g. ``creditrl train algorithm.estimator=maxpo algorithm.k=4 train.steps=100``.
Set CREDITRL_DEBUG=1 to see full tracebacks instead of one-line errors.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

LAZY_COMMANDS = {  # subcommand -> (module, function taking argv and returning an exit code)
    "compare": ("creditrl.studies.compare", "main",
                "run several configs x seeds and write one comparison report"),
    "experiment": ("creditrl.studies.experiments", "main", "run the papers' experiments (bandit, variance, curves)"),
}


def _config_help() -> str:
    from creditrl.config import Config, flat_items
    width = max(len(k) for k, _ in flat_items(Config()))
    lines = [f"  {k:<{width}}  {json.dumps(v)}" for k, v in flat_items(Config())]
    return ("config keys (set with key=value; defaults shown; null = automatic/off):\n" + "\n".join(lines) +
            "\n\nexamples:\n  creditrl train\n  creditrl train algorithm.estimator=maxpo algorithm.k=4 train.steps=100\n"
            "  creditrl train --config my.yaml model.name=/path/to/hf-model task.name=jsonl "
            "task.options.path=data.jsonl\n  creditrl train --resume runs/addition-otb-s0-20250101-120000")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="creditrl", description="Critic-free RL post-training of LLMs "
                                     "(OTB, MaxPO, STAPO, GRPO-λ) that runs on a CPU.", formatter_class=raw)
    sub = parser.add_subparsers(dest="command", metavar="{train,eval,compare,estimators,experiment}")

    train = sub.add_parser("train", help="train a policy (defaults: builtin:tiny on addition)",
                           description="Train with the default config, a YAML file and/or key=value overrides.",
                           epilog=_config_help(), formatter_class=raw)
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    train.add_argument("--config", metavar="FILE", help="YAML config file (merged over the defaults)")
    train.add_argument("--resume", metavar="DIR", help="continue the interrupted run in DIR exactly "
                       "(its config.yaml and newest checkpoint; no other options allowed)")
    train.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same "
                       "train.run_name and start again (without it an existing run is refused)")
    train.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in CI logs)")

    ev = sub.add_parser("eval", help="held-out greedy accuracy and pass@k / avg@k",
                        description="Evaluate a run's final model (--run) or any model given by config keys "
                        "(model.name, task.name, ...). Prints JSON.", epilog=_config_help(), formatter_class=raw)
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    ev.add_argument("--config", metavar="FILE", help="YAML config file")
    ev.add_argument("--run", metavar="DIR", help="a finished run: uses DIR/config.yaml and the model in DIR/final")
    ev.add_argument("--n", type=int, help="samples per prompt (default train.eval_samples)")
    ev.add_argument("--k", type=int, nargs="+", help="k values for pass@k/avg@k (default train.pass_k)")
    ev.add_argument("--problems", type=int, help="held-out prompts used (default train.eval_problems)")
    ev.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")

    sub.add_parser("estimators", help="list the registered advantage estimators",
                   description="List every registered advantage estimator with its one-line description.")
    for name, (_, _, text) in LAZY_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def cmd_train(args) -> int:
    from creditrl.config import load_config
    from creditrl.trainer import resume, train

    start = time.perf_counter()
    if args.resume:
        if args.config or args.overrides or args.overwrite:
            raise ValueError("--resume: a resumed run uses its saved config.yaml; drop --config, --overwrite and "
                             "key=value")
        run_dir = resume(args.resume, progress=not args.no_progress)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = train(cfg, progress=False if args.no_progress else None, overwrite=args.overwrite)
    print((run_dir / "summary.md").read_text())
    print(f"run directory: {run_dir}  (total wall time incl. model load/warm start: "
          f"{(time.perf_counter() - start) / 60:.1f} min)")
    return 0


def cmd_eval(args) -> int:
    from creditrl.config import apply_overrides, eval_settings, load_config, load_saved_config
    from creditrl.runtime.evaluation import evaluate
    from creditrl.runtime.setup import build_task, default_max_new_tokens, load_configured_policy, resolve_device

    weights = None
    if args.run:
        from pathlib import Path
        run = Path(args.run)
        if not (run / "config.yaml").is_file():
            raise FileNotFoundError(f"--run: {str(run)!r} has no config.yaml; expected a creditrl run directory")
        if not (run / "final").is_dir():
            raise FileNotFoundError(f"--run: {str(run / 'final')!r} not found; the run has not finished")
        cfg = apply_overrides(load_saved_config(run / "config.yaml"), args.overrides)
        weights = str(run / "final")   # the task keeps the format of the run's model.name (a LoRA
                                       # final/ is an adapter whose base has the same template)
    else:
        cfg = load_config(args.config, args.overrides)
    task = build_task(cfg)
    model, tokenizer = load_configured_policy(cfg, task, resolve_device(cfg.train.device), not args.no_progress,
                                              name=weights)
    limit, samples, ks = eval_settings(cfg)
    problems = task.test_set()
    limit = args.problems or limit
    problems = problems[:limit] if limit else problems
    r = cfg.rollout
    result = evaluate(model, tokenizer, task, problems, n=args.n or samples,
                      ks=args.k or [k for k in ks if k <= (args.n or samples)], temperature=r.temperature,
                      top_p=r.top_p, max_new_tokens=r.max_new_tokens or default_max_new_tokens(task, tokenizer),
                      max_tool_tokens=r.max_tool_tokens, seed=cfg.train.seed, stop_strings=tuple(r.stop))
    text = json.dumps({"model": cfg.model.name if weights is None else weights, "task": cfg.task.name, **result},
                      indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


def cmd_estimators(args) -> int:
    import creditrl.core.estimators  # noqa: F401  (registers the built-ins)
    from creditrl.core.estimators.registry import get_estimator, list_estimators
    from rich.console import Console
    from rich.table import Table

    table = Table("estimator", "needs energy", "description")
    for name in list_estimators():
        spec = get_estimator(name)
        table.add_row(name, "yes" if spec.needs_energy else "", spec.doc)
    Console().print(table)
    return 0


def run_lazy(name: str, argv: list[str]) -> int:
    module_name, function, _ = LAZY_COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            print(f"creditrl {name}: not available in this installation ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    if not hasattr(module, function):
        print(f"creditrl {name}: not available yet ({module_name}.{function} is missing)", file=sys.stderr)
        return 2
    return int(getattr(module, function)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LAZY_COMMANDS:  # they parse their own options (and --help)
        return run_lazy(argv[0], argv[1:])
    parser = build_parser()
    # key=value may come before or after options (argparse ends a subcommand's positionals at the first option)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in extra):
            parser.parse_args(argv)  # exits with argparse's own message
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help()
        return 2
    from creditrl.config import ConfigError
    from creditrl.trainer.loop import TrainingStopped
    handlers = {"train": cmd_train, "eval": cmd_eval, "estimators": cmd_estimators}
    try:
        return handlers[args.command](args)
    except (ConfigError, ImportError, OSError, TrainingStopped, ValueError) as err:
        if os.environ.get("CREDITRL_DEBUG"):
            raise
        print(f"creditrl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
