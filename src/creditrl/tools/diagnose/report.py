"""`creditrl diagnose`'s outputs: diagnose.md (the report), diagnose.json (every number, intervals as
[value, low, high]) and diagnose.png (efficiency at matched signal with its 95% interval per
estimator). Each file is written to a temporary name and renamed (``creditrl.utils.io``), the report
last, so a killed run never leaves a report that looks whole."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from creditrl.core.gradients import Interval
from creditrl.tools import tables
from creditrl.utils.io import atomic_write_text

SKETCH_ERROR = ("Count sketch (Charikar et al. 2002): E<Sa, Sb> = <a, b> exactly, Var<Sa, Sb> ≤ 2‖a‖²‖b‖²/d, so a "
                "squared norm's relative error is at most sqrt(2/d) = {rel:.2%} per pair of vectors (d = {dim:,}); "
                "the statistics average many such products, and the sketch's error adds to the sampling error "
                "already inside the intervals.")


def plain(value):
    """JSON-ready: Intervals as [value, low, high], NaN as null."""
    if isinstance(value, Interval):
        return [plain(value.value), plain(value.low), plain(value.high)]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return plain(dataclasses.asdict(value))
    return value


def table(rows: list[dict]) -> str:
    cells = [{"estimator": f"`{r['estimator']}`" + ("" if r["ranked"] else " (max@K)"),
              "efficiency vs rloo": str(r["efficiency_vs_rloo"]), "efficiency vs grpo": str(r["efficiency_vs_grpo"]),
              "scale c": str(r["scale"]), "cosine": str(r["cosine"]), "raw tr Cov (raw)": str(r["raw_variance"]),
              "non-zero groups": f"{r['nonzero_fraction']:.0%}", "energy": "yes" if r["needs_energy"] else "",
              "advantages ms/group": tables.fmt(r["advantage_ms_per_group"], 2)} for r in rows]
    return tables.markdown_table(cells)


def noise_section(noise: dict, group_size: int) -> list[str]:
    b, gain, progress, share = noise["noise_scale"], noise["snr_gain"], noise["progress_gain"], noise["within_share"]
    return ["## Would a larger group pay? The gradient noise scale\n",
            f"B_simple = tr Σ / ‖G‖² = **{b}** groups for `{noise['estimator']}` at N = {group_size} (McCandlish et "
            f"al. 2018; Σ the covariance of one group's gradient, G the true gradient; estimated without bias, ‖G‖² "
            f"from pairs of groups of different prompts). {share} of tr Σ is variance within a prompt (W), the rest "
            f"across prompts (A).\n",
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


def markdown(result: dict) -> str:
    s, rec = result["setting"], result["recommendation"]
    lines = [f"# creditrl diagnose: `{s['model']}` on `{s['task']}`\n",
             f"{s['prompts']} prompts × {s['groups_per_prompt']} groups × N = {s['group_size']} responses "
             f"({s['groups']} groups, temperature {s['temperature']}, up to {s['max_new_tokens']} new tokens, seed "
             f"{s['seed']}); {result['informative_fraction']:.0%} of groups informative (reward spread > 0). "
             f"Gradient space: {s['space']}. Intervals: 95% jackknife t over {s['folds']} folds of prompts. "
             f"Wall time {result['timing']['total_s'] / 60:.1f} min.\n",
             "## Recommendation\n", rec["text"] + ".\n",
             "## Estimators at matched signal\n",
             "Efficiency (V_b/c_b²)/(V_e/c_e²) > 1: the estimator needs that many times fewer groups than b for the "
             "same signal-to-noise (an optimizer like Adam is blind to the gradient's scale). c and cosine: its mean "
             "gradient against rloo's (unbiased; c = 1, cosine = 1 is unbiased). The raw tr Cov is raw: a shrunken "
             "gradient (c < 1) lowers it without any gain. `dr_grpo` is exactly (N−1)/N × rloo.\n",
             table(result["estimators"]), *noise_section(result["noise"], s["group_size"]),
             "## Gradient space and cost\n", f"{s['space']}.", result["sketch_error"] or "",
             f"\nProbe: {result['timing']['probe_s_per_group']:.2f} s per group; sampling "
             f"{result['timing']['sampling_s']:.0f} s, gradients {result['timing']['gradients_s']:.0f} s, gradient "
             f"statistics {result['timing']['statistics_s']:.0f} s in all. "
             "The energies ŵ_t that otb/ogb/otb_isolated need come from the same fused forward as the log-probs, "
             "so their extra cost is the advantage computation shown.\n"]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    fig, (ax,) = tables.figure(1, width=max(4.5, 0.45 * len(rows)))
    for shift, key, label in ((-0.12, "efficiency_vs_rloo", "vs rloo"), (0.12, "efficiency_vs_grpo", "vs grpo")):
        ivs = [r[key] for r in rows]
        err = [[max(iv.value - iv.low, 0) if math.isfinite(iv.low) else 0 for iv in ivs],
               [max(iv.high - iv.value, 0) if math.isfinite(iv.high) else 0 for iv in ivs]]
        ax.errorbar([i + shift for i in range(len(rows))], [iv.value for iv in ivs], yerr=err, fmt="o", ms=3,
                    capsize=2, label=f"efficiency {label}")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xticks(range(len(rows)), [r["estimator"] for r in rows], rotation=45, ha="right", fontsize=7)
    ax.set(yscale="log", ylabel="efficiency at matched signal (95% CI)", title="creditrl diagnose")
    ax.legend(fontsize=7)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    tables.save_figure(fig, tmp)
    os.replace(tmp, path)
    return path


def write(run_dir: Path, result: dict) -> Path:
    """diagnose.png, diagnose.json, then diagnose.md (each atomic); returns the report's path."""
    plot(result["estimators"], run_dir / "diagnose.png")
    atomic_write_text(run_dir / "diagnose.json", json.dumps(plain(result), indent=2, sort_keys=True) + "\n")
    atomic_write_text(run_dir / "diagnose.md", markdown(result))
    return run_dir / "diagnose.md"
