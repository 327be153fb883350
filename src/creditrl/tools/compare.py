"""``creditrl compare``: several configs × seeds (one after another, or ``--jobs`` at once), in one report.

    creditrl compare --run otb algorithm.estimator=otb --run grpo algorithm.estimator=grpo \\
        --seeds 0,1,2 --out runs/compare train.steps=40
    creditrl compare --spec compare.yaml          # the same, from a file

KEY=VALUE right after ``--run NAME`` are that run's own, up to the next option or ``--``; overrides
for every run go before the options, after another option, or after ``--``. The report lists every
config key that differs between the runs, and warns when one differs that no run's own overrides set.

A spec file holds ``config`` (base YAML, optional), ``overrides`` (for every run), ``seeds`` and
``runs`` (name -> list of ``key=value`` overrides). Each run × seed trains into
``OUT/runs/<name>-s<seed>``; a finished one trained from the same config and overrides is reused
unless ``--force``, one trained from others is refused unless ``--force`` (which retrains it,
deleting it), and a directory there that is not a creditrl training run is always refused.
The report (``OUT/report.md``, ``OUT/compare.png``, ``OUT/final.csv``, ``OUT/curves.csv``) is
built from the runs' metrics.jsonl / eval.jsonl only, so ``--report-only`` redraws it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch

from creditrl.config import load_config, read_yaml
from creditrl.recipe.resolve import resolve_config
from creditrl.tools import tables
from creditrl.utils.plots import step_axis
from creditrl.trainer import train
from creditrl.trainer.loop import TrainingStopped
from creditrl.utils import cli
from creditrl.utils.imports import PluginError
from creditrl.utils.rundir import RunDirError, occupant
from creditrl.utils.validate import check_int

PANELS = (  # (metric, x axis) of the report figure
    ("reward_mean", "step"), ("reward_mean", "tokens_total"), ("accuracy", "step"), ("accuracy", "tokens_total"),
    ("entropy", "step"), ("grad_norm", "step"), ("power_proxy", "step"), ("greedy_acc", "tokens_total"),
)
FINAL_TRAIN = ("reward_mean", "accuracy", "entropy", "grad_norm", "power_proxy", "adam_variance", "spurious_ratio",
               "response_len")
EVAL_METRICS = ("greedy_acc",)
COMPARE_OWNS = ("train.seed", "train.output_dir", "train.run_name")
RECIPE_FILE = "compare_recipe.json"  # base config + overrides a run was trained with (reuse check)  # held-out metrics whose curve is read from eval.jsonl


@dataclass
class CompareSpec:
    runs: dict[str, list[str]]
    seeds: list[int] = field(default_factory=lambda: [0])
    config: str | None = None
    overrides: list[str] = field(default_factory=list)


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def check_run(where: str, name: object, items: object) -> None:
    """One run of a spec: a name usable as a directory name and a list of ``key=value`` strings."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise ValueError(f"{where}: expected a run name of letters, digits and _ . + - (it names the run's "
                         f"directory), got {name!r}")
    if not isinstance(items, list) or not all(isinstance(i, str) and "=" in i for i in items):
        raise ValueError(f"{where} {name}: expected a list of 'key=value' strings, got {items!r}")


def check_seeds(where: str, seeds: object) -> list[int]:
    """A non-empty list of distinct integer seeds in [0, 2**32)."""
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32 for s in seeds)):
        raise ValueError(f"{where}: expected a non-empty list of integers in [0, 2**32 - 1], got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}: expected distinct seeds (each trains into its own directory), got {seeds}")
    return seeds


def load_spec(path: Path) -> CompareSpec:
    """Read a YAML spec; errors name the key and the expected form (a key given twice included)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--spec: file not found: {path}")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with runs (and optionally seeds, config, overrides), got "
                         f"{type(data).__name__}")
    allowed = {"runs", "seeds", "config", "overrides"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; valid keys are {sorted(allowed)}")
    runs = data.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise ValueError(f"{path}: runs: expected a mapping name -> list of key=value overrides, got {runs!r}")
    for name, items in runs.items():
        check_run(f"{path}: runs", name, items)
    seeds = check_seeds(f"{path}: seeds", data.get("seeds", [0]))
    overrides = data.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(i, str) and "=" in i for i in overrides):
        raise ValueError(f"{path}: overrides: expected a list of 'key=value' strings, got {overrides!r}")
    config = data.get("config")
    if config is not None and not isinstance(config, str):
        raise ValueError(f"{path}: config: expected a YAML file path or a packaged config's name, got {config!r}")
    return CompareSpec(runs=dict(runs), seeds=seeds, config=config, overrides=list(overrides))


def run_dir(out: Path, name: str, seed: int) -> Path:
    return Path(out) / "runs" / f"{name}-s{seed}"


@dataclass(frozen=True)
class PlannedRun:
    """One run × seed of a compare: its directory, its recipe (the reuse check) and its resolved config."""
    name: str
    target: Path
    recipe: dict
    cfg: object


def plan_runs(spec: CompareSpec, out: Path, *, progress: bool = True) -> list[PlannedRun]:
    """Every run × seed of ``spec``, each config validated before the first long run."""
    for name, overrides in {"(every run)": spec.overrides, **spec.runs}.items():
        owned = [o for o in overrides if o.split("=", 1)[0].strip() in COMPARE_OWNS]
        if owned:
            raise ValueError(f"{name}: {owned}: compare sets {', '.join(COMPARE_OWNS)} itself (seeds from --seeds or "
                             f"the spec's seeds, directories OUT/runs/NAME-sSEED); drop them")
    plans = []
    for name, overrides in spec.runs.items():
        for seed in spec.seeds:
            target = run_dir(out, name, seed)
            recipe = {"config": spec.config, "overrides": [*spec.overrides, *overrides, f"train.seed={seed}"],
                      "run_overrides": list(overrides)}
            plans.append(PlannedRun(name, target, recipe, resolve_config(load_config(spec.config, [
                *recipe["overrides"], f"train.output_dir={target.parent}", f"train.run_name={target.name}",
                f"logging.progress={str(progress).lower()}"]))))
    return plans


def train_planned(plan: PlannedRun) -> Path:
    """Train one planned run into a clean directory and stamp its recipe (a process pool's task)."""
    print(f"[creditrl compare] training {plan.target.name} -> {plan.target}", flush=True)
    # a partial or (``check_replaceable``) forced run starts clean, never appends: ``train`` deletes
    # it only once the new run has loaded its model, and only a training run
    target = Path(train(plan.cfg, overwrite=True))
    (target / RECIPE_FILE).write_text(json.dumps(plan.recipe))
    return target


def train_runs(plans: list[PlannedRun], *, force: bool = False, jobs: int = 1,
               failures: dict[str, str] | None = None) -> dict[str, list[Path]]:
    """Train the plans not already finished with the same recipe, ``jobs`` at a time (separate processes;
    a run's result does not depend on ``jobs``, since each run is seeded and sets its own threads).
    Returns the run directories by run name, in plan order. A run's error is raised, unless ``failures``
    is given: then the other runs go on, each failed run's error is recorded there (by its directory's
    name) and only the finished runs are returned."""
    check_int("jobs", jobs, low=1)
    todo = [p for p in plans if force or not (p.target / "summary.json").exists()
            or not (p.target / RECIPE_FILE).exists()
            or _trained_from(json.loads((p.target / RECIPE_FILE).read_text())) != _trained_from(p.recipe)]
    check_replaceable(todo, force)
    failed = {}
    if jobs == 1 or len(todo) < 2:
        for plan in todo:
            failed.update(_outcome(plan, lambda plan=plan: train_planned(plan), failures is not None))
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=get_context("spawn")) as pool:
            for plan, future in [(plan, pool.submit(train_planned, plan)) for plan in todo]:
                failed.update(_outcome(plan, future.result, failures is not None))   # a run's error comes back here
    if failures is not None:
        failures.update(failed)
    dirs: dict[str, list[Path]] = {}
    for plan in plans:
        if plan.target.name not in failed:
            dirs.setdefault(plan.name, []).append(plan.target)
    return dirs


def check_replaceable(plans: list[PlannedRun], force: bool) -> None:
    """Before any run trains: each directory a plan would replace holds a creditrl training run, and
    a finished one only with ``force``, so neither a mistyped ``--out`` nor a changed override
    deletes anyone's work silently."""
    for plan in plans:
        target, found = plan.target, occupant(plan.target)
        if found == "file":
            raise RunDirError(f"compare: {str(target)!r} exists and is not a directory; move it or choose another --out")
        if found is None:
            continue
        if found != "train":
            raise RunDirError(f"compare: {str(target)!r} exists and is not a creditrl training run (compare trains "
                              f"each run into OUT/runs/NAME-sSEED); move it or choose another --out")
        if (target / "summary.json").exists() and not force:
            recipe = target / RECIPE_FILE
            was = _trained_from(json.loads(recipe.read_text())) if recipe.is_file() else None
            now = _trained_from(plan.recipe)
            if was is None:
                how = f"it has no {RECIPE_FILE} (a run compare did not train)"
            elif was["config"] != now["config"]:
                how = f"it was trained from config {was['config']!r}, this compare's is {now['config']!r}"
            else:
                gone = [o for o in was["overrides"] if o not in now["overrides"]]
                new = [o for o in now["overrides"] if o not in was["overrides"]]
                how = (f"it was trained with {gone} where this compare sets {new}" if gone or new else
                       "the same overrides in another order, which can change the config")
            raise RunDirError(f"compare: {str(target)!r} is a finished run from another recipe ({how}); "
                              f"--force retrains it (deleting it), or choose another --out")


def _trained_from(recipe: dict) -> dict:
    """What a run was trained from (the reuse check): its base config and every override."""
    return {k: recipe.get(k) for k in ("config", "overrides")}


def _outcome(plan: PlannedRun, run, keep_going: bool) -> dict[str, str]:
    """{} when ``run()`` finished, else {run directory name: its error} (raised unless ``keep_going``)."""
    try:
        run()
        return {}
    except Exception as err:  # noqa: BLE001 - any run's failure is reported beside the runs that finished
        if not keep_going:
            raise
        print(f"[creditrl compare] {plan.target.name} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return {plan.target.name: f"{type(err).__name__}: {err}"}


def run_all(spec: CompareSpec, out: Path, *, force: bool = False, progress: bool = True,
            jobs: int = 1, failures: dict[str, str] | None = None) -> dict[str, list[Path]]:
    """Train every run × seed (``jobs`` at a time); returns dirs by run (``train_runs``: ``failures``)."""
    return train_runs(plan_runs(spec, out, progress=progress and jobs == 1), force=force, jobs=jobs,
                      failures=failures)


def find_runs(out: Path) -> dict[str, list[Path]]:
    """Existing run dirs under ``OUT/runs`` grouped by run name (``<name>-s<seed>``)."""
    dirs: dict[str, list[Path]] = {}
    for path in sorted((Path(out) / "runs").glob("*-s*")):
        if (path / "metrics.jsonl").exists():
            dirs.setdefault(path.name.rsplit("-s", 1)[0], []).append(path)
    if not dirs:
        raise FileNotFoundError(f"--out: no runs with metrics.jsonl under {Path(out) / 'runs'}")
    return dirs


def check_finished(runs: dict[str, list[Path]]) -> None:
    """Every run of a redrawn report finished (its summary.json): an interrupted one's last rows
    would stand beside the others' end-of-run numbers as if they were its own."""
    unfinished = [f"{path.name} (step {(read_jsonl(path / 'metrics.jsonl') or [{}])[-1].get('step', 0)})"
                  for dirs in runs.values() for path in dirs if not (path / "summary.json").is_file()]
    if unfinished:
        raise ValueError(f"--report-only: expected finished runs, got {len(unfinished)} unfinished "
                         f"({', '.join(unfinished)}: no summary.json); rerun the same compare, which resumes "
                         f"them, then redraw")


def check_seeds_trained(runs: dict[str, list[Path]]) -> None:
    """Every run directory ``<run>-s<seed>`` of a redrawn report holds the run trained with that seed
    (its config.yaml's ``train.seed``): a copy of another seed's run would be counted as one more seed."""
    missing = [path.name for dirs in runs.values() for path in dirs if not (path / "config.yaml").is_file()]
    if missing:
        raise ValueError(f"--report-only: expected each run directory to hold its config.yaml (which every run "
                         f"writes first), got none in {', '.join(missing)}: its seed and settings are unknown")
    copies = [f"{path.name} (train.seed={seed})" for dirs in runs.values() for path in dirs
              if (seed := trained_seed(path)) != path.name.rsplit("-s", 1)[1]]
    if copies:
        raise ValueError(f"--report-only: expected each run directory <run>-s<seed> to hold the run trained with that "
                         f"train.seed, got {', '.join(copies)} in config.yaml: a copied or renamed run would count as "
                         f"another seed; remove it or give it its own seed's run")


def trained_seed(path: Path) -> str:
    """The ``train.seed`` a run's config.yaml records, as its directory name writes it ('?' if unreadable)."""
    try:
        return str(int(read_yaml(path / "config.yaml")["train"]["seed"]))
    except (OSError, KeyError, TypeError, ValueError):
        return "?"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(records: list[dict], key: str, x: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[key]) for r in records if isinstance(r.get(key), (int, float)) and isinstance(r.get(x), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def smooth(values: torch.Tensor, window: int) -> torch.Tensor:
    """Trailing moving average (window clipped at the start), [..., S] -> [..., S]."""
    if window <= 1 or values.shape[-1] == 0:
        return values
    csum = torch.nn.functional.pad(values.cumsum(-1), (1, 0))
    idx = torch.arange(values.shape[-1])
    lo = (idx + 1 - window).clamp(min=0)
    return (csum[..., idx + 1] - csum[..., lo]) / (idx + 1 - lo).to(values.dtype)


def seed_curves(dirs: list[Path], metric: str, x: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S] (mean over seeds) and y [seeds, S] of ``metric``, truncated to the shortest seed."""
    source = "eval.jsonl" if metric in EVAL_METRICS else "metrics.jsonl"
    series = [_series(read_jsonl(d / source), metric, x) for d in dirs]
    length = min((len(s[0]) for s in series), default=0)
    xs = torch.tensor([s[0][:length] for s in series], dtype=torch.float64).reshape(len(series), length)
    ys = torch.tensor([s[1][:length] for s in series], dtype=torch.float64).reshape(len(series), length)
    return xs.mean(0), ys


def curves_rows(runs: dict[str, list[Path]], metrics: tuple[str, ...], window: int) -> list[dict]:
    """Per run and step: tokens, and mean/std over seeds of each (smoothed) training metric."""
    rows = []
    for name, dirs in runs.items():
        steps, tokens = seed_curves(dirs, "tokens_total", "step")
        columns = {"tokens_total": tokens.mean(0)}
        for m in metrics:
            _, ys = seed_curves(dirs, m, "step")
            if ys.shape[-1] == steps.numel():
                ys = smooth(ys, window)
                columns[f"{m}_mean"], columns[f"{m}_std"] = ys.mean(0), _std(ys)
        for i, step in enumerate(steps.tolist()):
            rows.append({"run": name, "step": int(step), **{k: float(v[i]) for k, v in columns.items()}})
    return rows


def _std(ys: torch.Tensor) -> torch.Tensor:
    return ys.std(0, unbiased=True) if ys.shape[0] > 1 else torch.zeros_like(ys[0])


def final_rows(runs: dict[str, list[Path]], tail: float = 0.1) -> list[dict]:
    """One row per run × seed: last held-out eval + training metrics averaged over the last ``tail`` of steps."""
    rows = []
    for name, dirs in runs.items():
        for d in dirs:
            metrics, evals = read_jsonl(d / "metrics.jsonl"), read_jsonl(d / "eval.jsonl")
            last = metrics[-max(1, int(len(metrics) * tail)):]
            row = {"run": name, "seed": d.name.rsplit("-s", 1)[1], "steps": len(metrics),
                   "tokens_total": metrics[-1].get("tokens_total", float("nan")) if metrics else float("nan")}
            for m in FINAL_TRAIN:
                vals = [r[m] for r in last if isinstance(r.get(m), (int, float))]
                row[m] = sum(vals) / len(vals) if vals else float("nan")
            if evals:
                row.update({k: v for k, v in evals[-1].items() if k.startswith(("greedy", "sampled", "pass@", "avg@"))})
                row.update({f"start_{k}": v for k, v in evals[0].items() if k in ("greedy_acc", "sampled_acc")})
            rows.append(row)
    return rows


def mean_std_table(rows: list[dict], columns: list[str]) -> str:
    """Markdown table of ``mean ± std`` over seeds, one line per run."""
    table = []
    for name, members in tables.group_rows(rows, "run").items():
        entry = {"run": name, "seeds": len(members)}
        for c in columns:
            vals = torch.tensor([float(m[c]) for m in members if isinstance(m.get(c), (int, float))], dtype=torch.float64)
            vals = vals[torch.isfinite(vals)]
            if vals.numel() == 0:
                entry[c] = "–"
            else:
                # one seed has no spread to show: "± 0" would read as a measured zero
                entry[c] = (f"{float(vals.mean()):.3g} ± {float(vals.std()):.2g}" if vals.numel() > 1
                            else f"{float(vals.mean()):.3g} (one seed)")
        table.append(entry)
    return tables.markdown_table(table, ["run", "seeds", *columns])


def plot_panels(runs: dict[str, list[Path]], panels, path: Path, window: int, ncols: int = 4) -> Path:
    """Mean over seeds (line) with a ±1 std band, one panel per (metric, x axis)."""
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = tables.figure(min(ncols, len(panels)), nrows, width=3.6, height=2.8)
    for ax, (metric, x) in zip(axes, panels):
        for name, dirs in runs.items():
            xs, ys = seed_curves(dirs, metric, x)
            if ys.shape[-1] == 0:
                continue
            if metric not in EVAL_METRICS:
                ys = smooth(ys, window)
            mean, std = ys.mean(0), _std(ys)
            (line,) = ax.plot(xs.numpy(), mean.numpy(), label=name, lw=1.2, marker="o" if xs.numel() < 8 else None, ms=3)
            ax.fill_between(xs.numpy(), (mean - std).numpy(), (mean + std).numpy(), color=line.get_color(), alpha=0.2)
        if x == "step":
            step_axis(ax)                              # whole steps, not 1.25, 1.75
        ax.set(xlabel="generated tokens" if x == "tokens_total" else x, title=metric)
        ax.tick_params(labelsize=7)
    for ax in axes[len(panels):]:
        ax.axis("off")
    axes[0].legend(fontsize=7)
    return tables.save_figure(fig, path)


def run_warnings(runs: dict[str, list[Path]]) -> list[str]:
    """Each run's end-of-run warning (summary.json ``warning``, e.g. "this run learned nothing"),
    as report lines naming the run and its directory."""
    lines = []
    for name, dirs in runs.items():
        for d in dirs:
            summary = d / "summary.json"
            warning = json.loads(summary.read_text()).get("warning") if summary.is_file() else None
            if warning:
                lines.append(f"- **{name}** (`{d.name}`): {warning}\n")
    return lines


NOT_COMPARED = {*COMPARE_OWNS, "logging.progress"}   # differ by construction, or change no number


def _flat(data: object, prefix: str = "") -> dict[str, str]:
    """A nested config mapping as dotted key -> its value in JSON (lists and empty mappings whole)."""
    if not isinstance(data, dict) or not data:
        return {prefix: json.dumps(data, sort_keys=True, default=str)}
    out = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _explained(key: str, own: set[str]) -> bool:
    """Whether a differing config key follows from some run's own overrides: the key itself or one
    below it, a sibling inside a section an override sets (``loss.stapo.enabled`` -> ``loss.stapo.*``),
    or an estimator's options (filled per ``algorithm.estimator``)."""
    for o in own:
        parent = o.rsplit(".", 1)[0] if o.count(".") >= 2 else None
        if key == o or key.startswith(o + ".") or (parent and key.startswith(parent + ".")):
            return True
    return "algorithm.estimator" in own and (key == "algorithm.options" or key.startswith("algorithm.options."))


def config_differences(runs: dict[str, list[Path]]) -> list[str]:
    """Report lines: every config key (config.yaml, seeds and directories aside) whose value differs
    between the runs, each run's value; a warning first when a key differs that no run's own
    overrides set (``compare_recipe.json``): those runs were trained with different shared settings
    (overrides of another invocation, a different base config), so they are not comparable."""
    values: dict[str, dict[str, str]] = {}
    own: set[str] = set()
    known = True
    for name, dirs in runs.items():
        for d in dirs:
            if not (d / "config.yaml").is_file():
                return []
            for key, value in _flat(read_yaml(d / "config.yaml")).items():
                if key not in NOT_COMPARED:
                    seen = values.setdefault(key, {})
                    seen[name] = value if seen.get(name, value) == value else "(differs between seeds)"
            recipe = d / RECIPE_FILE
            run_overrides = json.loads(recipe.read_text()).get("run_overrides") if recipe.is_file() else None
            if run_overrides is None:
                known = False
            else:
                own.update(o.split("=", 1)[0].strip() for o in run_overrides)
    differ = {k: v for k, v in values.items() if len(set(v.values())) > 1 or len(v) < len(runs)}
    if not differ:
        return [] if len(runs) < 2 else ["## Config\n", "The runs' configs are identical (seeds aside: each run's "
                                         "are in its directory name, `<run>-s<seed>`).\n"]
    shared = [k for k in differ if not _explained(k, own)] if known else []
    lines = []
    if shared:
        lines += ["## Warning: these runs are not comparable\n",
                  f"They differ in {', '.join(f'`{k}`' for k in shared)}, which no run's own overrides set: they were "
                  f"trained with different shared settings (another compare's overrides, or a different base config). "
                  f"Retrain them in one compare, with the same overrides for every run.\n"]
    rows = [{"config key": f"**{k}**" if k in shared else k, **{n: v.get(n, "–") for n in runs}}
            for k, v in differ.items()]
    lines += ["## Config keys that differ between the runs\n",
              ("" if known else "(Some runs have no record of their own overrides, so whether a difference is one "
               "they compare is not known.)\n"),
              tables.markdown_table(rows, ["config key", *runs])]
    return [line for line in lines if line]


def write_report(runs: dict[str, list[Path]], out: Path, *, window: int | None = None,
                 panels=PANELS, title: str = "creditrl compare", failures: dict[str, str] | None = None) -> Path:
    """report.md + compare.png + final.csv + curves.csv in ``out``; returns report.md's path.
    ``failures``: run directory name -> error of the runs that did not finish (listed first)."""
    out = Path(out)
    steps = max(len(read_jsonl(d / "metrics.jsonl")) for dirs in runs.values() for d in dirs)
    window = window if window is not None else max(1, steps // 20)
    final = final_rows(runs)
    tables.write_csv(out / "final.csv", final)
    tables.write_csv(out / "curves.csv", curves_rows(runs, FINAL_TRAIN, window))
    plot_panels(runs, panels, out / "compare.png", window)
    eval_cols = [c for c in final[0] if c.startswith(("start_greedy", "greedy", "sampled", "pass@"))]
    warnings = run_warnings(runs)   # e.g. a run that learned nothing: never averaged away silently
    lines = [f"# {title}\n", f"Runs: {', '.join(f'{k} ({len(v)} seeds)' for k, v in runs.items())}. "
             f"Curves: mean over seeds, band ±1 std, moving average over {window} steps. The tables describe the "
             f"seeds run (mean ± sample std); no test of a difference is made and no run is declared better: "
             f"with a few seeds, means within about a std of each other are not told apart (a verdict needs "
             f"more seeds and a test, as `creditrl experiment` runs).\n",
             *(["## Runs that failed (not in the tables or curves)\n",
                *[f"- `{name}`: {error}\n" for name, error in failures.items()]] if failures else []),
             *config_differences(runs),
             *(["## Warnings from the runs\n", *warnings] if warnings else []),
             "![curves](compare.png)\n", "## Held-out evaluation at the end (mean ± std over seeds)\n",
             mean_std_table(final, eval_cols) if eval_cols else "_(no eval.jsonl)_\n",
             "## Training metrics over the last 10% of steps (mean ± std over seeds)\n",
             mean_std_table(final, ["tokens_total", *FINAL_TRAIN])]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="creditrl compare", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides applied to every run: before the options, after another option "
                             "(--out DIR train.steps=40) or after `--`; KEY=VALUE right after --run NAME are that "
                             "run's own, up to the next option (refused when they end the command line and set keys "
                             "no other run sets: ambiguous)")
    parser.add_argument("--spec", type=Path, help="YAML spec with config / overrides / seeds / runs")
    parser.add_argument("--config", action=cli.GivenOnce,
                        help="base config YAML for every run (default: the packaged defaults)")
    parser.add_argument("--run", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                        help="one configuration: a name then its own overrides, up to the next option or `--` "
                             "(repeat for each run)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: the spec's, else 0)")
    parser.add_argument("--out", type=lambda text: Path(text).expanduser(), default=Path("runs") / "compare",
                        help="output dir (default: runs/compare)")
    parser.add_argument("--force", action="store_true",
                        help="retrain runs that already finished (deleting them); without it a finished run from "
                        "another config or overrides is refused")
    parser.add_argument("--report-only", action="store_true",
                        help="only redraw the report from OUT/runs (finished runs, each <run>-s<seed> trained with "
                             "that train.seed)")
    parser.add_argument("--smooth", type=int, default=None, help="moving-average window in steps (default: steps/20)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at once, each in its own process (default 1; with more, no progress bars; "
                             "jobs x train.threads should not exceed the cores)")
    return parser


def check_last_run(argv: list[str], spec: CompareSpec) -> None:
    """Refuse the one ambiguous form: KEY=VALUE items after the last ``--run NAME`` that reach the
    end of the command line and set keys no other run sets. argparse gives them to that run, yet
    they read like overrides for every run (``--run b algorithm.estimator=rloo train.steps=2``); the
    runs would then differ in them silently. Ended by ``--`` or another option, they are that run's."""
    starts = [i for i, a in enumerate(argv) if a == "--run" or a.startswith("--run=")]
    if len(spec.runs) < 2 or not starts:
        return
    tail = argv[starts[-1]:]
    if any(a.startswith("-") for a in tail[1:]):
        return                                    # ended by `--` or another option: unambiguous
    name, *items = ([tail[0].split("=", 1)[1]] if tail[0] != "--run" else []) + tail[1:]
    others = {o.split("=", 1)[0].strip() for n, overrides in spec.runs.items() if n != name for o in overrides}
    alone = [o for o in items if o.split("=", 1)[0].strip() not in others]
    if alone:
        raise ValueError(f"--run {name}: {' '.join(alone)} come after the last --run and set keys no other run sets, "
                         f"so they apply to {name} only, not to every run; put overrides for every run before the "
                         f"options or after `--` (... --run {name} {' '.join(o for o in items if o not in alone)} -- "
                         f"{' '.join(alone)}), or end {name}'s own overrides with `--`")


def spec_from_args(args) -> CompareSpec:
    spec = load_spec(args.spec) if args.spec else CompareSpec(runs={})
    for name, *overrides in args.run:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"--run {name}: expected KEY=VALUE overrides after the name, got {bad}")
        check_run("--run", name, overrides)
        if name in spec.runs:
            raise ValueError(f"--run: duplicate run name {name!r} (each run needs its own name)")
        spec.runs[name] = overrides
    if not spec.runs:
        raise ValueError("--run/--spec: expected at least one run, got none (e.g. --run otb algorithm.estimator=otb)")
    if args.seeds is not None:
        try:
            seeds = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            raise ValueError(f"--seeds: expected comma-separated integers such as 0,1,2, got {args.seeds!r}") from None
        spec.seeds = check_seeds("--seeds", seeds)
    if args.config:
        spec.config = args.config
    spec.overrides = [*spec.overrides, *args.overrides]
    return spec


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # key=value may come before or after options
    failures: dict[str, str] = {}
    try:
        if args.smooth is not None and args.smooth < 1:
            raise ValueError(f"--smooth: expected a moving-average window of at least 1 step, got {args.smooth}")
        check_int("--jobs", args.jobs, low=1)
        if args.report_only:
            if args.run or args.spec or args.seeds is not None or args.force or args.overrides or args.config:
                raise ValueError("--report-only: redraws the report from OUT/runs alone; drop --run, --spec, --seeds, "
                                 "--config, --force and key=value")
            runs = find_runs(args.out)
            check_finished(runs)
            check_seeds_trained(runs)
        else:
            if args.out.exists() and not args.out.is_dir():     # before any run: each would fail on it
                raise ValueError(f"--out: expected a directory (made if missing), got {str(args.out)!r}, a file")
            spec = spec_from_args(args)
            check_last_run(sys.argv[1:] if argv is None else list(argv), spec)
            runs = run_all(spec, args.out, force=args.force, progress=not args.no_progress,
                           jobs=args.jobs, failures=failures)
            if not runs:
                raise TrainingStopped(f"every run failed ({'; '.join(f'{k}: {v}' for k, v in failures.items())})")
        path = write_report(runs, args.out, window=args.smooth, failures=failures)
    except (ValueError, OSError, ImportError, PluginError, TrainingStopped) as err:
        if os.environ.get("CREDITRL_DEBUG"):
            raise
        print(f"creditrl compare: error: {err}", file=sys.stderr)
        return 2
    print(f"[creditrl compare] report: {path}")
    if failures:
        print(f"creditrl compare: error: {len(failures)} run(s) failed ({', '.join(failures)}); the report covers the "
              f"runs that finished and lists the failed ones", file=sys.stderr)
        return 1
    return 0
