"""`creditrl diagnose [--config F] [--overwrite] [key=value ...]`: the `train` config (model, LoRA,
task, rollout, estimator options) plus its ``diagnose`` section, so the measurement runs on exactly
the setting a user is about to train. Everything the config names is checked before the model
loads; the memory limit once the model's parameters are known, before any sampling."""
from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from creditrl.config import Config, load_config
from creditrl.recipe import reference
from creditrl.recipe.resolve import resolve_config, resolve_device
from creditrl.recipe.build import build_task, default_max_new_tokens, load_configured_policy
from creditrl.tools.diagnose.plan import Plan, choose_space, make_plan
from creditrl.tools.diagnose.run import diagnose_policy
from creditrl.utils import cli
from creditrl.utils.rundir import check_new_run
from creditrl.utils.threads import torch_threads


HELP = "measure which estimator gives the best gradient on this model/task"


def main(argv: list[str]) -> int:
    parser = cli.config_parser(
        "diagnose", HELP, "Sample diagnose.prompts prompts x diagnose.groups_per_prompt groups with the configured "
        "policy and compare every estimator's exact gradient at matched signal; writes diagnose.md/.json/.png to a "
        "run directory. Same config as `train` plus diagnose.*.", reference.epilog())
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory of the same "
                        "diagnose.run_name once the new report is complete (without it an existing one is refused)")
    args = cli.parse(parser, argv)

    def run() -> int:
        run_dir = run_command(load_config(args.config, args.overrides), overwrite=args.overwrite,
                              progress=not args.no_progress)
        print((run_dir / "diagnose.md").read_text())
        return 0
    return cli.run("diagnose", run)


def run_dir_of(cfg: Config, plan: Plan) -> Path:
    name = cfg.diagnose.run_name or (f"diagnose-{Path(cfg.task.name).name.replace(':', '-')}-"
                                     f"{Path(cfg.model.name).name.replace(':', '-')}-s{plan.seed}-"
                                     f"{datetime.now():%Y%m%d-%H%M%S}")
    return Path(cfg.train.output_dir).expanduser() / name


def run_command(cfg: Config, *, overwrite: bool = False, progress: bool = True) -> Path:
    """The whole command; returns the run directory."""
    start = time.perf_counter()
    cfg = resolve_config(cfg)
    plan = make_plan(cfg)
    run_dir = run_dir_of(cfg, plan)
    check_new_run(run_dir, overwrite=overwrite, key="diagnose.run_name", resume_hint=False)   # deleted once done
    task = build_task(cfg)
    threads = cfg.train.threads or (1 if cfg.model.name == "builtin:tiny" else None)
    with torch_threads(threads):
        model, tokenizer = load_configured_policy(cfg, task, resolve_device(cfg.train.device), progress)
        d = cfg.diagnose
        space = choose_space(model, d.params, len(plan.specs), plan.folds, plan.groups_per_prompt, d.max_memory_gb,
                             d.sketch_dim)
        r = cfg.rollout
        rollout = {"temperature": r.temperature, "top_p": r.top_p, "max_tool_tokens": r.max_tool_tokens,
                   "max_new_tokens": r.max_new_tokens or default_max_new_tokens(task, tokenizer),
                   "stop_strings": tuple(r.stop)}
        setting = {"model": cfg.model.name, "task": cfg.task.name + (f" {dict(cfg.task.options)}" if cfg.task.options
                                                                     else ""), "configured": plan.configured}
        diagnose_policy(model, tokenizer, task, plan, space, rollout, setting=setting, run_dir=run_dir,
                        overwrite=overwrite, progress=progress)
    print(f"run directory: {run_dir}  (total wall time incl. model load: {(time.perf_counter() - start) / 60:.1f} min)")
    return run_dir
