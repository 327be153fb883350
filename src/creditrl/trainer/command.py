"""``creditrl train [--config F] [key=value ...]`` and ``creditrl train --resume DIR``."""
from __future__ import annotations

import time

from creditrl.config import load_config
from creditrl.utils import cli
from creditrl.utils.durations import format_duration
from creditrl.utils.imports import load_object

# imported once the arguments and the config are checked: a refusal comes in a fraction of a second,
# not after torch and transformers load (~6 s on a 2-core CPU)
LOOP, REFERENCE = "creditrl.trainer.loop", "creditrl.recipe.reference"

HELP = "train a policy (defaults: builtin:tiny on addition)"
EXAMPLES = """examples:
  creditrl train
  creditrl train algorithm.estimator=maxpo algorithm.options.k=4 train.steps=100
  creditrl train --config my.yaml model.name=/path/to/hf-model task.name=jsonl task.options.path=data.jsonl
  creditrl train --resume runs/addition-otb-s0-20250101-120000
  creditrl config > docs/config.md"""


def main(argv: list[str]) -> int:
    parser = cli.config_parser("train", HELP, "Train with the default config, a YAML file and/or key=value overrides.",
                               lambda: load_object(f"{REFERENCE}:epilog")() + "\n\n" + EXAMPLES)
    parser.add_argument("--resume", metavar="DIR", help="continue the interrupted run in DIR exactly (its config.yaml "
                        "and newest checkpoint; no other options allowed; a finished run is refused: raise train.steps in its "
                        "config.yaml to train on)")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same "
                        "train.run_name and start again, once the new run has checked its config and loaded its "
                        "model (without it an existing run is refused)")
    args = cli.parse(parser, argv)
    return cli.run("train", lambda: run(args))


def run(args) -> int:
    start = time.perf_counter()
    if args.resume:
        if args.config or args.overrides or args.overwrite:
            raise ValueError("--resume: a resumed run uses its saved config.yaml; drop --config, --overwrite and "
                             "key=value (to change a key that may change mid-run, such as optim.lr or train.steps, "
                             "edit DIR/config.yaml)")
        run_dir = load_object(f"{LOOP}:resume")(args.resume, progress=not args.no_progress)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = load_object(f"{LOOP}:train")(cfg, progress=False if args.no_progress else None,
                                               overwrite=args.overwrite)
    print((run_dir / "summary.md").read_text())
    print(f"run directory: {run_dir}  (total wall time incl. model load/warm start: "
          f"{format_duration(time.perf_counter() - start)})")
    return 0
