"""End-of-run report: PNG plots of the main curves and a one-page summary (Markdown + JSON).

The summary compares the held-out eval before the first update (the warm-start model) with
the final one: greedy accuracy, sampled accuracy, pass@k; plus tokens used and wall time.
"""
from __future__ import annotations

import json
from pathlib import Path

from creditrl.utils.durations import format_duration
from creditrl.utils.plots import figure, save_figure, step_axis

TRAIN_CURVES = ("reward_mean", "accuracy", "entropy", "response_len", "clipped_frac", "grad_norm", "update_ratio",
                "power_proxy", "approx_kl", "clip_frac_high", "noise_scale", "filtered_frac")
OUTCOME_CURVES = ("reward_mean", "accuracy")
LOG_SCALE = ("noise_scale", "update_ratio")   # B_simple and ||Δθ||/||θ|| span orders of magnitude


def train_curves(metrics: list[dict]) -> list[str]:
    """The curves train.png draws: those of ``TRAIN_CURVES`` logged and nonzero at some step (approx_kl
    is 0 at every on-policy step), and the outcome's whatever their values: a run whose reward stayed
    0 must show it."""
    return [k for k in TRAIN_CURVES if any(m.get(k) for m in metrics) or
            k in OUTCOME_CURVES and any(m.get(k) is not None for m in metrics)]


def plot_run(run_dir: Path, metrics: list[dict], evals: list[dict]) -> list[Path]:
    """plots/train.png (a panel per curve vs step) and plots/eval.png (held-out metrics vs step)."""
    folder = run_dir / "plots"
    folder.mkdir(exist_ok=True)
    written = []
    if metrics:
        # curves that are 0 throughout (e.g. approx_kl on-policy) would only take room
        keys = train_curves(metrics)
        cols = 4
        rows = max(1, (len(keys) + cols - 1) // cols)
        fig, axes = figure(cols, rows, width=4, height=3)
        steps = [m["step"] for m in metrics]
        for ax, key in zip(axes, keys):
            ax.plot(steps, [m.get(key) if m.get(key) is not None else float("nan") for m in metrics])
            ax.set_title("noise scale B_simple (groups)" if key == "noise_scale" else key)
            if key in LOG_SCALE:
                ax.set_yscale("log")
            step_axis(ax)
        for ax in list(axes)[len(keys):]:
            ax.axis("off")
        written.append(save_figure(fig, folder / "train.png", dpi=90))
    labels = sorted({k.split("/")[1] for m in metrics for k in m if k.startswith("diagnose/") and k.count("/") == 2})
    if labels:
        written.append(plot_diagnosis(folder / "diagnose.png", metrics, labels))
    if evals:
        # pass@1 equals sampled_acc (unbiased estimator, eq. 1): one line, both names
        keys = [k for k in evals[-1] if k in ("greedy_acc", "sampled_acc") or k.startswith("pass@") and k != "pass@1"]
        fig, (ax,) = figure(width=6, height=4)
        for key in keys:
            label = "sampled_acc (= pass@1)" if key == "sampled_acc" else key
            ax.plot([e["step"] for e in evals], [e.get(key) for e in evals], marker="o", label=label)
        step_axis(ax)
        ax.set_ylabel("held-out")
        ax.legend()
        written.append(save_figure(fig, folder / "eval.png", dpi=90))
    return written


def plot_diagnosis(path: Path, metrics: list[dict], labels: list[str]) -> Path:
    """plots/diagnose.png: each compared estimator's efficiency against the one trained over the steps,
    with its 95% interval (in-training diagnosis; undefined points left out)."""
    fig, (ax,) = figure(width=6, height=4)
    for label in labels:
        points = [(m["step"], m[f"diagnose/{label}/efficiency"], m.get(f"diagnose/{label}/efficiency_low"),
                   m.get(f"diagnose/{label}/efficiency_high")) for m in metrics if f"diagnose/{label}/efficiency" in m]
        if not points:
            continue
        steps, values = [p[0] for p in points], [p[1] for p in points]
        line, = ax.plot(steps, values, marker="o", ms=3, label=label)
        band = [p for p in points if p[2] is not None and p[3] is not None]
        if band:
            ax.fill_between([p[0] for p in band], [p[2] for p in band], [p[3] for p in band], alpha=0.15,
                            color=line.get_color())
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set(yscale="log", ylabel="efficiency vs the estimator trained", title="in-training diagnosis")
    step_axis(ax)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=90)


def write_summary(run_dir: Path, *, title: str, metrics: list[dict], evals: list[dict], wall_time: float,
                  extra: dict | None = None, completions: list[dict] | None = None, shown: int = 3,
                  sections: list[str] | None = None) -> dict:
    """summary.json + summary.md (with ``sections``: further Markdown lines, and ``shown`` train
    completions of the first and the last step, when given); returns the summary dict."""
    start, end = (evals[0], evals[-1]) if evals else ({}, {})
    keys = [k for k in end if k in ("greedy_acc", "sampled_acc") or k.startswith(("pass@", "avg@", "greedy_acc/"))]
    summary = {
        "title": title, "steps": metrics[-1]["step"] if metrics else 0,
        "tokens_total": metrics[-1]["tokens_total"] if metrics else 0, "wall_time_s": round(wall_time, 1),
        "start": {k: start.get(k) for k in keys}, "end": {k: end.get(k) for k in keys},
        "start_step": start.get("step"), "end_step": end.get("step"),
        # the mean sampled reward of the last 10 steps, or of every step in a shorter run (the count says which)
        "train_reward_last10": (sum(m["reward_mean"] for m in metrics[-10:]) / len(metrics[-10:])) if metrics else None,
        "train_reward_last10_steps": len(metrics[-10:]),
        **(extra or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# {title}", "",
             f"- steps: {summary['steps']}, generated tokens: {summary['tokens_total']:,}, "
             f"wall time: {format_duration(wall_time)}",
             f"- held-out problems: {end.get('n_problems', '?')}, samples per problem: {end.get('n_samples', '?')}",
             "", "| held-out metric | start (step %s) | end (step %s) | change |" % (start.get("step"), end.get("step")),
             "|---|---|---|---|"]
    for k in keys:
        a, b = start.get(k), end.get(k)
        change = f"{b - a:+.3f}" if a is not None and b is not None else ""
        lines.append(f"| {k} | {a:.3f} | {b:.3f} | {change} |" if a is not None else f"| {k} | | {b:.3f} | |")
    for name in ("train.png", "eval.png", "diagnose.png"):
        if (run_dir / "plots" / name).is_file():
            lines += ["", f"![{name}](plots/{name})"]
    for key, value in (extra or {}).items():
        lines.append(f"- {key}: {value}")
    if sections:
        lines += ["", *sections]
    if completions:
        steps = sorted({c["step"] for c in completions})
        for step in dict.fromkeys((steps[0], steps[-1])):
            lines += ["", f"### Sample completions, step {step}", ""]
            for c in [c for c in completions if c["step"] == step][:shown]:
                prompt = c["prompt"][-160:].replace("\n", "⏎")
                lines.append(f"- reward {c['reward']:.2f}, {c['length']} tokens, "
                             f"{'stopped' if c['stopped'] else 'CLIPPED'}: `…{prompt}` → `{c['completion']}`")
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def diagnosis_section(metrics: list[dict], labels: list[str]) -> list[str]:
    """summary.md's in-training diagnosis (``logging.diagnose_every``): the last diagnosed step's window
    (efficiency against the estimator trained, 95% interval, cosine) and the cost of a diagnosed step
    against a plain one (rollout + update time of the steps not diagnosed)."""
    diagnosed = [m for m in metrics if "time_diagnose" in m]
    if not diagnosed:
        return []
    last = diagnosed[-1]
    rows = ["| estimator | efficiency vs trained | 95% interval | cosine to rloo |", "|---|---|---|---|"]
    for label in labels:
        value = last.get(f"diagnose/{label}/efficiency")
        low, high = last.get(f"diagnose/{label}/efficiency_low"), last.get(f"diagnose/{label}/efficiency_high")
        cosine = last.get(f"diagnose/{label}/cosine")
        c_low, c_high = last.get(f"diagnose/{label}/cosine_low"), last.get(f"diagnose/{label}/cosine_high")
        rows.append(f"| `{label}` | {_num(value)} | " + (f"[{low:.3g}, {high:.3g}]" if low is not None and high is not None
                                                          else "undefined") + f" | {_num(cosine)}"
                    + (f" [{c_low:.3g}, {c_high:.3g}]" if c_low is not None and c_high is not None else "") + " |")
    plain = [m["time_rollout"] + m["time_update"] for m in metrics if "time_diagnose" not in m and "time_update" in m]
    cost = sum(m["time_diagnose"] for m in diagnosed) / len(diagnosed)
    ratio = (f"; a plain step takes {sum(plain) / len(plain):.2f} s, so a diagnosed step costs "
             f"{(sum(plain) / len(plain) + cost) / (sum(plain) / len(plain)):.2f}× a plain one" if plain else "")
    noise = last.get("diagnose/noise_scale")
    return ["## In-training diagnosis", "",
            f"{len(diagnosed)} diagnosed step(s); the window at step {last['step']} holds the last "
            f"{int(last['diagnose/steps'])}: matched-signal efficiency against the estimator trained (each of a step's "
            f"groups a unit, 95% jackknife intervals over the steps; undefined while a mean gradient is not resolved "
            f"or the window holds one step).", "", *rows, "",
            f"B_simple of the estimator trained: {'undefined' if noise is None else f'{noise:.3g} groups'}. Cost: {cost:.2f} s of diagnosis per diagnosed "
            f"step{ratio}.", ""]


def _num(value) -> str:
    return "undefined" if value is None else f"{value:.3g}"


NO_SIGNAL_STEPS = 5   # consecutive steps without a reward signal before the live warning


def no_signal(metrics: dict) -> str | None:
    """Why a step could not learn from its rewards: ``"invalid"`` (every reward NaN/inf or a
    checker error, counted as 0), ``"uniform"`` (dynamic sampling kept no group: no update),
    ``"zero_spread"`` (every group's rewards equal, and the advantages carry no difference between
    responses: all 0, or every reward of the step equal), ``"nothing_kept"`` (every token left the
    loss: kept_frac 0), or None. Flat groups still teach an estimator that compares across groups
    (``reinforce``, ``reinforce_plus_plus``, ``shrinkage``; e.g. rollout.group_size=1) when the
    step's rewards differ: its advantages are then not 0."""
    if (metrics.get("reward_invalid_frac") or 0) >= 1:
        return "invalid"
    if metrics.get("kept_groups") == 0:
        return "uniform"
    if (metrics.get("zero_spread_frac") or 0) >= 1 and (
            not (metrics.get("reward_std") or 0) > 0 or _zero_advantages(metrics)):
        return "zero_spread"
    if metrics.get("kept_frac") == 0:
        return "nothing_kept"
    return None


def _zero_advantages(metrics: dict) -> bool:
    return metrics.get("adv_mean") == 0 and metrics.get("adv_std") == 0


def _reason(kind: str | None, steps: list[dict]) -> str:
    """Why ``steps`` (the steps a warning covers) had no reward signal; numbers from the last one
    except the mean reward, over all of them."""
    metrics = steps[-1]
    if kind == "uniform":
        return ("dynamic sampling kept no group (every sampled group's signal was the same for all its responses), "
                "so no update was made")
    if kind == "invalid":
        return ("every reward was invalid (NaN/inf, or the task's checker raised) and counted as 0: check the "
                "checker (task.options.checker) against the completions in completions.jsonl")
    if kind == "nothing_kept":
        return ("every token was dropped from the loss (kept_frac 0: e.g. loss.mask_truncated with every response "
                f"cut at rollout.max_new_tokens, clipped_frac {metrics.get('clipped_frac', float('nan')):.2g}, or a "
                "rollout correction dropping every token), so no step moved the policy")
    means = [m["reward_mean"] for m in steps if m.get("reward_mean") is not None]
    mean = f"{sum(means) / len(means):.3g}" if means else "undefined"
    if all((m.get("clipped_frac") or 0) >= 1 for m in steps):     # the likelier cause than the task's difficulty
        return (f"every response was cut at rollout.max_new_tokens (clipped_frac 1 at every step; mean reward "
                f"{mean}), so none could finish an answer and every group's rewards were equal: raise "
                f"rollout.max_new_tokens")
    if any((m.get("reward_std") or 0) > 0 for m in steps):
        return (f"every group's rewards were equal within the group (zero spread; mean reward {mean} over "
                f"{'those steps' if len(steps) > 1 else 'the step'}): rewards differed only between groups, which "
                f"the estimator does not compare (a larger rollout.group_size, or an estimator that compares "
                f"across groups, e.g. reinforce_plus_plus)")
    return (f"every group's rewards were equal (zero spread; mean reward {mean} over "
            f"{'those steps' if len(steps) > 1 else 'the step'}: within each step every response scored the same, "
            f"e.g. a task too hard or too easy for the model, or a reward that ignores the response)")


def streak_warning(steps: list[dict]) -> str | None:
    """The live warning once ``NO_SIGNAL_STEPS`` steps in a row (``steps``, the streak so far) had no
    reward signal."""
    if len(steps) != NO_SIGNAL_STEPS:
        return None
    return (f"warning: no reward signal for {len(steps)} steps in a row (step {steps[-1]['step']}): "
            f"{_reason(no_signal(steps[-1]), steps)}; a run like this learns nothing from its task")


def idle_update(metrics: dict) -> str | None:
    """Why a step that had a reward signal and made its update taught the policy nothing:
    ``"zero_gradient"`` (grad_norm exactly 0: every token the loss kept had advantage 0; momentum or
    weight decay may still move the weights), ``"unmoved"`` (a nonzero gradient, yet no sampled weight
    changed beyond float32 resolution: ``moved_frac`` 0), or None (the step moved the policy; or no
    update was made or it was skipped, or the step had no reward signal, which ``no_signal`` and the
    skip warnings explain)."""
    if "moved_frac" not in metrics or metrics.get("skipped_updates") or no_signal(metrics):
        return None
    if metrics.get("grad_norm") == 0:
        return "zero_gradient"
    return "unmoved" if metrics["moved_frac"] == 0 else None


def _idle_reasons(steps: list[dict], optim) -> str:
    """Why ``steps`` (each with an ``idle_update`` kind) taught nothing: one reason per kind, each from
    its own steps' numbers."""
    kinds = [idle_update(m) for m in steps]
    return "; at the others, ".join(_idle_reason(kind, [m for m, k in zip(steps, kinds) if k == kind], optim)
                                    for kind in dict.fromkeys(kinds))


def _idle_reason(kind: str, steps: list[dict], optim) -> str:
    if kind == "zero_gradient":
        entropy = steps[-1].get("high_entropy_frac")
        hint = ("" if entropy is None else f" (loss.top_entropy kept {entropy:.2%} of the tokens at the last step: "
                "raise loss.top_entropy.quantile)")
        return ("the loss's gradient was exactly 0 (grad_norm 0) although the rewards differed: every token the "
                f"loss kept had advantage 0{hint}")
    norm, lr, ratio = (max(m[k] for m in steps) for k in ("grad_norm", "lr", "update_ratio"))
    return (f"the gradient was not 0 (grad_norm up to {norm:.3g}), yet no sampled weight changed by more than half a "
            f"float32 ulp of its size or the model's RMS weight (update_ratio at most {ratio:.2g}): an AdamW "
            f"step moves each weight by about the learning rate (at most {lr:.3g} here; optim.lr={optim.lr:g}), and "
            f"less where the clipped gradient's elements are below AdamW's eps of 1e-8 (optim.max_grad_norm="
            f"{optim.max_grad_norm:g}): raise whichever is tiny")


def idle_warning(steps: list[dict], optim) -> str | None:
    """The live warning once ``NO_SIGNAL_STEPS`` steps in a row (``steps``, the streak so far) had a
    reward signal and an idle update (``idle_update``)."""
    if len(steps) != NO_SIGNAL_STEPS:
        return None
    return (f"warning: {len(steps)} steps in a row with a reward signal taught the policy nothing (step "
            f"{steps[-1]['step']}): {_idle_reasons(steps, optim)}; a run like this learns nothing")


def rewards_taught_nothing(metrics: list[dict], optim) -> str | None:
    """The end-of-run warning when every step that had a reward signal made an idle update
    (``idle_update``), saying why (``learned_nothing`` covers a run with no signal at any step)."""
    steps = [m for m in metrics if "moved_frac" in m and not no_signal(m)]
    if not steps or not all(idle_update(m) for m in steps):
        return None
    return (f"this run learned nothing from its rewards. At every one of the {len(steps)} steps with a reward "
            f"signal, {_idle_reasons(steps, optim)}")


def learned_nothing(metrics: list[dict], estimator: str) -> str | None:
    """The end-of-run warning when no step of the run had a reward signal, saying why and whether
    the advantages (hence the policy gradient's reward part) were zero throughout."""
    kinds = [no_signal(m) for m in metrics]
    if not metrics or None in kinds:
        return None
    kind = kinds[0] if len(set(kinds)) == 1 else "zero_spread"
    zero = all(m.get("kept_groups") == 0 or _zero_advantages(m) for m in metrics)
    effect = ("no step made an update" if kind == "uniform" else
              "the loss had no token to learn from" if kind == "nothing_kept" else
              "the advantages were 0 at every step, so nothing was learned from the rewards" if zero else
              f"{estimator} still gave advantages, but the rewards never said which responses were better")
    return (f"this run learned nothing from its task. At all {len(metrics)} steps "
            f"{_reason(kind, metrics)}; {effect}")
