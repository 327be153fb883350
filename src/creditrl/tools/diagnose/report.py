"""`creditrl diagnose`'s outputs: diagnose.md (the report), diagnose.json (every number, intervals as
[value, low, high]) and diagnose.png (efficiency at matched signal with its 95% interval per row).
No file holds "nan": an undefined number is "undefined" in the report (with why, and the prompts the
trend needs), ``null`` in the JSON (with its reason under "undefined"), and left out of the plot
(marked "undefined"). Each file is written to a temporary name and renamed (``creditrl.utils.io``),
the report last, so a killed run never leaves a report that looks whole."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from creditrl.core.gradients import Interval
from creditrl.tools import tables
from creditrl.utils.durations import format_duration
from creditrl.utils.io import atomic_write_text
from creditrl.utils.plots import plain_log_ticks

SKETCH_ERROR = ("Count sketch (Charikar et al. 2002): E<Sa, Sb> = <a, b> exactly, Var<Sa, Sb> ≤ 2‖a‖²‖b‖²/d, so a "
                "squared norm's relative error is at most sqrt(2/d) = {rel:.2%} per pair of vectors (d = {dim:,}); "
                "the statistics average many such products, and the sketch's error adds to the sampling error "
                "already inside the intervals.")
STOPS = {"resolved": "the stopping rule held (reference resolved, interval within the target)",
         "budget": "the time budget ran out (diagnose.budget_min)",
         "exhausted": "the task had no further distinct prompts"}


def plain(value):
    """JSON-ready: Intervals as [value, low, high], NaN and inf as null."""
    if isinstance(value, Interval):
        return [plain(value.value), plain(value.low), plain(value.high)]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return plain(dataclasses.asdict(value))
    return value


def cell(value) -> str:
    """An Interval or a number as a table cell; "undefined" for NaN, "—" for a column not measured."""
    if value is None:
        return "—"
    if isinstance(value, Interval):
        return str(value)
    return tables.fmt(value, 2)


def table(rows: list[dict], labels: dict, several_losses: bool) -> str:
    mark = {**{r: "better" for r in labels["better"]}, **{r: "worse" for r in labels["worse"]}}
    cells = []
    for r in rows:
        tags = [mark[r["row"]]] if r["row"] in mark else []
        tags += ["biased direction"] if r["row"] in labels["biased"] else []
        tags += ["max@K: not ranked"] if not r["ranked"] else []
        row = {"row": f"`{r['row']}`" + (f" ({', '.join(tags)})" if tags else "")}
        if several_losses:
            row["loss"] = r["loss"]
        row.update({"efficiency vs configured": cell(r["efficiency_vs_configured"]),
                    "Adam: vs configured": cell(r["adam_vs_configured"]),
                    "efficiency vs rloo": cell(r["efficiency_vs_rloo"]), "scale c": cell(r["scale"]),
                    "cosine": cell(r["cosine"]), "raw tr Cov (raw)": cell(r["raw_variance"]),
                    "non-zero groups": f"{r['nonzero_fraction']:.0%}", "energy": "yes" if r["needs_energy"] else "",
                    "advantages ms/group": cell(r["advantage_ms_per_group"])})
        cells.append(row)
    return tables.markdown_table(cells)


def undefined_notes(rows: list[dict], needed: float, prompts: int) -> list[str]:
    """One line per distinct reason a number is undefined, with the prompts the trend needs."""
    reasons, by_size = {}, {}
    for r in rows:
        if r["undefined"]:
            reasons.setdefault(r["undefined"], []).append(r["row"])
            by_size[r["undefined"]] = r["undefined_by_sample_size"]
    if not reasons:
        return []
    need = (f"the trend (standard errors shrink as 1/√prompts) says about {needed:,.0f} prompts would resolve it "
            f"({prompts} measured)" if math.isfinite(needed) else
            "the trend cannot say how many prompts would resolve it: the signal's estimate is not positive; a task "
            "where the model is more often partly right (more informative groups) helps more than prompts")
    return ["**Undefined values** (never guessed):\n"] + [
        f"- {', '.join(f'`{x}`' for x in which[:6])}{' …' if len(which) > 6 else ''}: undefined because {why}"
        + (f"; {need}." if by_size[why] else ".") for why, which in reasons.items()] + [""]


def noise_section(noise: dict, group_size: int) -> list[str]:
    b, gain, progress, share = noise["noise_scale"], noise["snr_gain"], noise["progress_gain"], noise["within_share"]
    clamped = "".join(f" The estimate of {k} ({v}) fell outside its possible range and is shown clamped to it."
                      for k, v in noise["clamped"].items())
    return ["## Would a larger group pay? The gradient noise scale\n",
            f"B_simple = tr Σ / ‖G‖² = **{b}** groups for `{noise['estimator']}` at N = {group_size} (McCandlish et "
            f"al. 2018; Σ the covariance of one group's gradient, G the true gradient; estimated without bias, ‖G‖² "
            f"from pairs of groups of different prompts). {share} of tr Σ is variance within a prompt (W), the rest "
            f"across prompts (A).{clamped}\n",
            f"**Doubling the group size (N = {group_size} → {2 * group_size}) would improve the signal-to-noise per "
            f"step by about {gain}×** at twice the sampling cost; doubling the prompts per step would give exactly "
            f"2× at the same cost. In McCandlish et al.'s model a step's best expected progress is ∝ 1/(1 + "
            f"B_noise/B); at B = {noise['batch']} groups per step (rollout.prompts_per_step) doubling N multiplies "
            f"it by about {progress}.\n",
            "```\nSNR per step ∝ B / tr Σ            tr Σ = W + A (within / across prompts, per group)\n"
            "group of 2N ≈ two groups of N on one prompt:  tr Σ' = W/2 + A\n"
            "SNR gain = (W + A) / (W/2 + A)      progress gain = (1 + B_noise/B) / (1 + B_noise'/B)\n```\n",
            "The approximation treats a group of 2N as two groups of N on the same prompt: exact for the responses' "
            "own sampling noise, it ignores the slightly better baseline of a larger group.\n"]


def power_text(power: dict, configured: str, column: str) -> str:
    if not power["comparisons"]:
        return "**Power:** undefined (no comparison is ranked with a defined interval).\n"
    where = "Adam" if column.startswith("adam") else "plain"
    return (f"**Power:** against `{configured}` this run detects an efficiency ratio of **{power['median']:.2f}×** "
            f"(or 1/{power['median']:.2f}) with 80% probability at the 5% family-wise level (median over "
            f"{power['comparisons']} comparisons in the {where} column; {power['low']:.2f}× to {power['high']:.2f}×); "
            f"smaller true differences are likely to read as ties.\n")


def setting_text(result: dict) -> str:
    s, m = result["setting"], result["measurement"]
    distinct = (f" The task ran out of distinct prompts after {s['prompts']}: every prompt is measured once, so "
                f"these are all it has." if m["exhausted"] else "")
    return (f"{s['prompts']} distinct prompts ({len(m['rounds'])} round(s) of up to {s['prompts_per_round']}) × "
            f"{s['groups_per_prompt']} groups × N = {s['group_size']} responses ({s['groups']} groups, temperature "
            f"{s['temperature']}, up to {s['max_new_tokens']} new tokens, seed {s['seed']}"
            f"{', precision ' + s['precision'] if s.get('precision') else ''}); stopped because "
            f"{STOPS.get(m['stop'], m['stop'])}.{distinct} {result['informative_fraction']:.0%} of groups "
            f"informative (reward spread > 0); {m['invalid']} of {m['responses']} rewards invalid. Gradient space: "
            f"{s['space']}. Intervals: 95% jackknife t over {s['folds']} folds of prompts; labels: Holm over the "
            f"comparisons with the configured row (5% family-wise). Wall time "
            f"{format_duration(result['timing']['total_s'])} (budget {format_duration(60 * s['budget_min'])}).\n"
            + "".join(f"\nNote: {note}.\n" for note in s.get("notes") or []))


def reference_text(result: dict) -> str:
    ref = result["reference"]
    state = "resolved" if ref["resolved"] else "**not resolved**"
    z = f"{ref['z']:.1f}" if math.isfinite(ref["z"]) else "undefined"
    return (f"Reference (the plain policy gradient of `rloo`, unbiased): cross-fitted ‖μ̂‖² = {ref['signal']}, "
            f"{z} standard errors above 0 ({state}; 3 needed). The configured row's efficiency interval is "
            f"±{ref['width']:.0%} wide (`{ref['width_row']}`; target ±{result['setting']['target_width']:.0%}).\n"
            if math.isfinite(ref["width"]) else
            f"Reference (the plain policy gradient of `rloo`, unbiased): cross-fitted ‖μ̂‖² = {ref['signal']}, "
            f"{z} standard errors above 0 ({state}; 3 needed); the configured row's efficiency interval is "
            f"undefined.\n")


def batch_level_notes(setting: dict) -> list[str]:
    """Rows whose estimator reads batch statistics: computed over training steps, and what that means."""
    labels = setting.get("batch_level") or []
    if not labels:
        return []
    step, sizes = setting.get("step"), setting.get("step_sizes") or [setting.get("step")]
    where = (f"over steps of {step} prompts of a round (one group each), as in training" if sizes == [step] else
             f"over steps of {' and '.join(map(str, sizes))} prompts of a round (one group each), **not the {step} of a "
             f"training step**: the {setting.get('prompts_per_round')} prompts of a round are not a multiple of "
             f"rollout.prompts_per_step, so their batch statistics come from fewer prompts than a training step's "
             f"(a multiple of {step} for diagnose.prompts matches training)")
    return [(f"Batch-level estimators ({', '.join(f'`{x}`' for x in labels)}) read statistics of the whole step: "
             f"their advantages are computed {where}. A step's groups then share its statistics; the variance "
             "above is per group given them and leaves out the covariance they add between a step's groups (the `grad-variance` experiment "
            "measures the variance of a step's sum for these estimators).\n")]


def loss_lines(result: dict) -> list[str]:
    out = ["## The loss measured\n"]
    for loss in result["setting"]["losses"]:
        out.append(f"- `{loss['name']}`: {loss['text']}, its gradient at the rollout policy (ratio 1, as on the first "
                   f"update of fresh samples; π_ref = π_θ for a KL term). Per group: −(1/N)∇(count · L), count the "
                   f"aggregation's denominator (token-mean's is the batch's token count, a constant across a step's "
                   f"groups to first order, so the scale c reflects it and the efficiency does not).")
        out += [f"  - {note}" for note in loss["notes"]]
    return out + [""]


def markdown(result: dict) -> str:
    s, rec = result["setting"], result["recommendation"]
    column = "Adam" if rec["column"].startswith("adam") else "plain"
    if column == "Adam":
        why = (f"The labels and the recommendation read the **Adam** column: v̂ comes from {s['adam_source']}, and "
               f"the trainer steps with AdamW, whose update is ĝ/√v̂, so signal-to-noise in that geometry is what "
               f"its updates feel.")
    elif s["adam_source"] != "none":
        why = (f"The labels and the recommendation read the **plain** column. The Adam column (ĝ/√v̂, v̂ from "
               f"{s['adam_source']}) is shown beside it: a short warm-up's v̂ carries its own estimation noise into "
               f"that column's intervals, so it informs rather than decides (with diagnose.optimizer_state=RUN_DIR, "
               f"v̂ from a real run's AdamW state, it decides).")
    else:
        why = "The labels and the recommendation read the **plain** column (no Adam column: diagnose.adam_warmup=0)."
    lines = [f"# creditrl diagnose: `{s['model']}` on `{s['task']}`\n", setting_text(result),
             "## Recommendation\n", rec["text"] + ".\n", why + "\n", power_text(result["power"], s["configured"],
                                                                             rec["column"]),
             reference_text(result), "## Rows at matched signal\n",
             "Efficiency (V_b/c_b²)/(V_e/c_e²) > 1: the row needs that many times fewer groups than b for the same "
             "signal-to-noise. c and cosine: its mean gradient against the reference's (c = 1, cosine = 1: "
             "unbiased). The raw tr Cov is raw: a shrunken gradient (c < 1) lowers it without any gain. Intervals "
             "are per comparison; the labels (better / worse than the configured row, biased direction: cosine "
             "measurably below 1) are the Holm-adjusted ones.\n",
             table(result["rows"], rec, len(s["losses"]) > 1),
             *undefined_notes(result["rows"], result["reference"]["needed"], s["prompts"]),
             *batch_level_notes(s),
             *noise_section(result["noise"], s["group_size"]), *loss_lines(result),
             "## Gradient space and cost\n", f"{s['space']}.", result["sketch_error"] or "",
             f"\nSampling {result['timing']['sampling_s_per_group']:.3g} s per group (a round's groups in one "
             f"batched generate call), gradients {result['timing']['gradients_s_per_group']:.3g} s per group "
             f"({result['measurement']['backward']} backward passes: a row whose cotangent is 0 or a multiple of "
             f"another's needs none), statistics {result['timing']['statistics_s']:.0f} s in all. The energies ŵ_t "
             f"come from the gradient's own forward, so an estimator's extra cost is its advantage computation.\n"]
    return "\n".join(lines)


def plot_points(rows: list[dict], key: str) -> list[tuple[int, Interval]]:
    """(row index, interval) of the rows whose ``key`` is drawn: point and interval defined (a point
    without its interval would read as an exact value; those rows are marked "undefined")."""
    return [(i, r[key]) for i, r in enumerate(rows) if r[key] is not None and r[key].defined and r[key].value > 0]


def holm_marks(rows: list[dict], labels: dict | None) -> list[tuple[int, str]]:
    """(row index, mark) of the rows the Holm-adjusted labels name (``recommend.label_rows``): better / worse
    than the configured row in the labels' column, biased direction; the per-comparison intervals alone
    would let a reader count an interval clear of 1 as a finding that Holm's correction does not keep."""
    if not labels:
        return []
    marks = []
    for i, r in enumerate(rows):
        tags = [tag for tag in ("better", "worse", "biased") if r["row"] in labels.get(tag, ())]
        if tags:
            marks.append((i, ", ".join("biased direction" if t == "biased" else t for t in tags)))
    return marks


def plot(rows: list[dict], path: Path, labels: dict | None = None) -> Path:
    """diagnose.png: each row's efficiency against the configured one (plain and Adam, 95% per-comparison
    intervals), with the Holm-adjusted labels of ``labels`` (``result["recommendation"]``) in the rows' names."""
    # tall enough for the rotated row names below and a log axis of about a decade above them
    fig, (ax,) = tables.figure(1, width=max(4.5, 0.45 * len(rows)), height=4.4)
    for shift, key, label in ((-0.12, "efficiency_vs_configured", "plain"), (0.12, "adam_vs_configured", "Adam")):
        points = plot_points(rows, key)
        if points:
            ivs = [iv for _, iv in points]
            err = [[max(iv.value - iv.low, 0) for iv in ivs], [max(iv.high - iv.value, 0) for iv in ivs]]
            ax.errorbar([i + shift for i, _ in points], [iv.value for iv in ivs], yerr=err, fmt="o", ms=3,
                        capsize=2, label=f"efficiency vs configured ({label})")
    for i, r in enumerate(rows):
        if not r["efficiency_vs_configured"].defined:
            ax.annotate("undefined", (i, 0.02), xycoords=("data", "axes fraction"), rotation=90, ha="center",
                        va="bottom", fontsize=6, color="gray")     # at the foot, clear of the points
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xlim(-0.5, len(rows) - 0.5)         # the first and last rows' marks clear of the frame
    marks = dict(holm_marks(rows, labels))           # in the row's name: never over an error bar
    names = [f"{r['row']} [{marks[i]}]" if i in marks else r["row"] for i, r in enumerate(rows)]
    ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=7)
    for i in marks:
        ax.get_xticklabels()[i].set_color("C3")
    ax.set(yscale="log", ylabel="efficiency (95% CI)")
    plain_log_ticks(ax.yaxis)
    ax.set_title("creditrl diagnose:\nefficiency at matched signal", fontsize=9)   # fits the narrowest figure
    if marks:
        ax.set_xlabel("[labels]: Holm-adjusted, family-wise 5%", fontsize=7, color="C3")
    if ax.get_legend_handles_labels()[0]:         # beside the axes: never over an error bar
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    tables.save_figure(fig, tmp)
    os.replace(tmp, path)
    return path


def write(run_dir: Path, result: dict) -> Path:
    """diagnose.png, diagnose.json, then diagnose.md (each atomic); returns the report's path."""
    plot(result["rows"], run_dir / "diagnose.png", result.get("recommendation"))
    data = plain({k: v for k, v in result.items() if k != "rows"})
    data["rows"] = [plain({k: v for k, v in r.items() if k != "cosine_raw"}) for r in result["rows"]]
    atomic_write_text(run_dir / "diagnose.json", json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
    atomic_write_text(run_dir / "diagnose.md", markdown(result))
    return run_dir / "diagnose.md"
