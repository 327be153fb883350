"""The training loop: sample prompts -> rollouts -> update -> log / eval / checkpoint.

Run directory (``train.output_dir/<run_name>``)::

    config.yaml      resolved config        metrics.jsonl   one record per step
    eval.jsonl       held-out evals          tensorboard/ trackio/ wandb/  (logging.report_to)
    completions.jsonl  sample completions per step and eval (prompt as rendered, reward, ...)
    checkpoints/     step_*/ (atomic, last K; none when save_every=0)
    final/           save_pretrained model (LoRA: adapters) + tokenizer
    plots/*.png      summary.md / summary.json
    precision.json   train.precision=auto: the probe's timings and the choice (also in config.yaml's comment)

Determinism: every random draw comes from the task stream ``random.Random(seed)`` or the
trainer's ``torch.Generator`` (both checkpointed); evals use their own seeded generator.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from creditrl.config import (Config, ConfigError, check_complete, check_overlong, config_from_dict, config_to_dict,
                             check_location_edit, eval_settings, read_saved_config, resume_changes, run_inputs,
                             run_place, save_config)
from creditrl.core.estimators.registry import get_estimator
from creditrl.trainer import checkpoint as ckpt
from creditrl.tasks.chat import check_prompt_lengths
from creditrl.runtime.evaluation import completion_records, evaluate
from creditrl.trainer.logging import RunLogger, read_jsonl, truncate_jsonl
from creditrl.trainer.report import (NO_SIGNAL_STEPS, diagnosis_section, idle_update, idle_warning, learned_nothing,
                                     no_signal, plot_run, rewards_taught_nothing, streak_warning, write_summary)
from creditrl.runtime.models import ModelDirError, disable_dropout, hf_progress, tiny_cache_path, warm_start_info
from creditrl.runtime.models.files import check_model_dir
from creditrl.runtime.precision import Precision, PrecisionChoice
from creditrl.runtime.dynamic_sampling import sample_varying_groups
from creditrl.runtime.rollout import RolloutBatch, concat_rollouts, generate_rollouts, rollout_metrics, sample_metrics
from creditrl.runtime.step_diagnosis import StepDiagnosis, compared_rows
from creditrl.core.estimators.labels import LOO
from creditrl.recipe.resolve import precision_of, resolve_config, resolve_device, resolve_loss
from creditrl.recipe.build import (ConfiguredLoss, build_task, check_lora_source, default_max_new_tokens,
                                   load_configured_policy, policy_loss_from_config, rollout_kwargs)
from creditrl.utils.rundir import (RunDirError, RunLock, check_new_run, clear_run, mark_run, missing_folders,
                                   remove_empty_folders, run_kind)
from creditrl.trainer.trackers import check_trackers
from creditrl.utils.errors import CreditrlError
from creditrl.utils.plots import require_matplotlib
from creditrl.utils.io import MANIFEST, atomic_directory, atomic_write_text, manifest_problem, write_manifest
from creditrl.trainer.precision import resolve_precision
from creditrl.core.losses import ON_POLICY_AS_CLIP, EntropyControl
from creditrl.trainer.update import Learner

TIMING_KEYS = ("tokens_per_s", "time_rollout", "time_update", "time_eval")
PRECISION_RECORD = "precision.json"   # train.precision=auto: what was timed and chosen
CLIPPED_WARNING = (0.5, 3)     # warn once when > half the responses hit the cap 3 steps in a row
MAX_SKIPPED_STEPS = 3          # consecutive steps whose every update was non-finite: stop the run


class TrainingStopped(CreditrlError):
    """The run cannot go on (e.g. repeated non-finite updates); the message names the likely cause."""


def set_determinism(cfg: Config) -> None:
    threads = cfg.train.threads or (1 if cfg.model.name.startswith("builtin:") else None)
    if threads:
        torch.set_num_threads(threads)
    if cfg.train.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, read when CUDA first uses it
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)


def reference_model(model, cfg: Config, loss: ConfiguredLoss, precision: Precision):
    """A frozen copy of the starting policy for a term of ``loss`` that needs reference log-probs
    (KL), in the precision's frozen dtype; None without one, and None for LoRA, whose reference is
    the same model with its adapters disabled (no second copy)."""
    if not loss.needs_reference or cfg.model.lora.enabled:
        return None
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    return ref if precision.frozen_dtype is None else ref.to(precision.frozen_dtype)


def precision_notes(model, cfg: Config) -> list[str]:
    """Warnings about weights that train in low precision (an AdamW step below half a bf16 ulp —
    ~0.4% of the weight — rounds back to the same value, so small updates vanish)."""
    low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
    if not low:
        return []
    return [f"warning: trainable weights are stored in {', '.join(low)} (model.dtype={cfg.model.dtype}): an "
            f"update smaller than half the weight's rounding step (~0.4% of it in bf16) is rounded away, so at "
            f"optim.lr={cfg.optim.lr} most weights may never change. Use model.dtype=float32 with "
            f"train.precision=bf16 (float32 weights, bf16 compute) instead"]


def component_notes(cfg: Config) -> list[str]:
    """A note when the estimator normalises each reward component (gdpo) but the run has one."""
    if not get_estimator(cfg.algorithm.estimator).reward_components or cfg.rollout.overlong.buffer or \
            cfg.task.options.get("rewards"):
        return []
    return [f"note: {cfg.algorithm.estimator} normalises each reward component on its own, and this run has one "
            f"(the task's reward): it is GRPO's z-score rescaled over the batch. Components come from "
            f"task.options.rewards (a file task's reward terms) and rollout.overlong"]


def on_policy_notes(loss, cfg: Config) -> list[str]:
    """A note when the chosen surrogate cannot act: in an on-policy single pass (one epoch, one
    mini-batch) every update has r = 1, where its gradient is the clip surrogate's."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if cfg.optim.epochs != 1 or (cfg.optim.minibatch_size or batch) < batch:
        return []
    same = [term.name for term, _ in loss.terms if term.name in ON_POLICY_AS_CLIP]
    if not same:
        return []
    return [f"note: loss.{same[0]}: every update of this run is on-policy (optim.epochs=1, one mini-batch: "
            f"π_θ = π_old, r = 1), where {same[0]}'s gradient is the clipped surrogate's A·∇log π, so it trains "
            f"exactly as the default loss; it acts from optim.epochs > 1 or optim.minibatch_size < {batch}"]


def idle_setting_notes(loss, cfg: Config) -> list[str]:
    """Warnings for legal settings that do less than they seem to: a warmup longer than the run
    (the learning rate never reaches ``optim.lr``), an entropy bonus switched on with β = 0."""
    notes = []
    warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
    if warmup > steps:   # the factor (step + 1) / warmup peaks on the last step
        notes.append(f"warning: optim.warmup_steps={warmup} > train.steps={steps}: the learning rate never reaches "
                     f"optim.lr={cfg.optim.lr}; it peaks at {steps / warmup:.0%} of it on the last step")
    for term, options in loss.terms:
        if term.name == "entropy_bonus" and options.coef == 0 and not options.adaptive:
            notes.append("warning: loss.entropy_bonus is on with coef=0 (and not adaptive), so it adds nothing to "
                         "the loss; set loss.entropy_bonus.coef > 0 or loss.entropy_bonus.adaptive=true")
        if term.name == "entropy_bonus" and options.coef < 0:
            notes.append(f"warning: loss.entropy_bonus.coef={options.coef} is negative: the term lowers the entropy "
                         "(an entropy penalty), the opposite of a bonus")
    return notes + idle_flat_options(loss, cfg)


def idle_flat_options(loss, cfg: Config) -> list[str]:
    """Flat options moved from their defaults where the setting that reads them is off (config.yaml
    gives every flat option, so these are warned of, not refused): model.tiny.* and model.warm_start.*
    of another model, a diagnosis interval longer than the run, and the loss's and schedule's own."""
    idle = []
    correction, kl = loss.options_of("rollout_correction"), loss.options_of("kl")
    defaults = {"correction": type(correction)(), "kl": type(kl)(), "optim": type(cfg.optim)()}   # as declared
    if correction.rollout_correction is None and correction.rollout_cap != defaults["correction"].rollout_cap:
        idle.append(f"loss.rollout_cap={correction.rollout_cap} (loss.rollout_correction is off)")
    if kl.kl_coef == 0 and (kl.kl_estimator != defaults["kl"].kl_estimator or kl.kl_bias_correction):
        idle.append(f"loss.kl_estimator={kl.kl_estimator!r} / kl_bias_correction={kl.kl_bias_correction} "
                    "(loss.kl_coef=0: no KL term)")
    if cfg.optim.schedule == "constant" and cfg.optim.min_lr_ratio != defaults["optim"].min_lr_ratio:
        idle.append(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} (optim.schedule=constant has no floor)")
    if cfg.model.name != "builtin:tiny":         # the shape and warm start of a model this run does not build
        for section in ("tiny", "warm_start"):
            given, default = getattr(cfg.model, section), type(getattr(cfg.model, section))()
            idle += [f"model.{section}.{f.name}={getattr(given, f.name)!r} (model.name is {cfg.model.name!r}, not "
                     f"builtin:tiny)" for f in dataclasses.fields(given)
                     if getattr(given, f.name) != getattr(default, f.name)]
    every = cfg.logging.diagnose_every
    if every > cfg.train.steps:
        idle.append(f"logging.diagnose_every={every} (> train.steps={cfg.train.steps}: no step is diagnosed)")
    return [f"warning: {text} does nothing" for text in idle]


def finished_steps(run_dir: Path) -> int:
    """The steps a finished run's summary.json (written after final/) records; 0 without one."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text()).get("steps") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def run_name(cfg: Config) -> str:
    task = cfg.task.name.replace(":", "-")   # a user task by import path
    return cfg.train.run_name or f"{task}-{cfg.algorithm.estimator}-s{cfg.train.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


class Trainer:
    """``Trainer(cfg).run()`` trains and returns the run directory; ``Trainer.resume(dir)``
    continues an interrupted run from its newest checkpoint."""

    def __init__(self, cfg: Config, run_dir: Path | None = None, *, progress: bool | None = None):
        check_trackers(cfg.logging.report_to)   # a missing tracker package is named before any work
        if cfg.logging.plots:
            require_matplotlib("logging.plots")
        cfg = resolve_config(cfg)                 # every library-declared option checked before loading
        check_lora_source(cfg)
        set_determinism(cfg)
        self.device = resolve_device(cfg.train.device)
        self.task = build_task(cfg)
        held_out = len(self.task.test_set())
        if cfg.train.eval_problems is not None and cfg.train.eval_problems > held_out:
            raise ConfigError(f"train.eval_problems: expected at most {held_out} (the task's held-out set), got "
                              f"{cfg.train.eval_problems}")
        show = cfg.logging.progress if progress is None else progress
        # builtin:tiny's warm-start cache, and whether an earlier run made it (the summary says which)
        self.tiny_cache = tiny_cache_path(self.task, cfg.model.tiny, cfg.model.warm_start, cfg.train.seed,
                                          cfg.model.cache_dir) if cfg.model.name == "builtin:tiny" else None
        self.warm_start_cached = self.tiny_cache is not None and warm_start_info(self.tiny_cache) is not None
        self.model, self.tokenizer = load_configured_policy(cfg, self.task, self.device, show)
        dropout = disable_dropout(self.model)
        if cfg.rollout.max_new_tokens is None:
            max_new = default_max_new_tokens(self.task, self.tokenizer)
            # an unset loss.max_len is the responses' budget (policy_loss_from_config): recorded as such
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=max_new),
                                      loss=resolve_loss(cfg.loss, max_new))
            check_overlong(cfg.rollout.overlong, max_new)
        cfg, self.precision_choice = resolve_precision(cfg, self.model, self.tokenizer, self.task)
        self.cfg = cfg
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.truncated_prompts = check_prompt_lengths(
            self.tokenizer, self.task, getattr(self.model.config, "max_position_embeddings", None),
            cfg.rollout.max_new_tokens)
        self.precision = precision_of(cfg)
        loss = policy_loss_from_config(cfg)      # the run's loss, composed once
        self.learner = Learner(self.model, cfg, loss, ref_model=reference_model(self.model, cfg, loss, self.precision))
        self.diagnosis = step_diagnosis(self.model, cfg, self.learner) if cfg.logging.diagnose_every else None
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        self.task_rng = random.Random(cfg.train.seed)
        self.step, self.tokens_total, self.elapsed = 0, 0, 0.0
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.train.output_dir).expanduser() / run_name(cfg)
        self.progress = show
        self.eval_problems, self.eval_samples, self.pass_k = eval_settings(cfg)
        test = self.task.test_set()
        self.test_problems = test[:self.eval_problems] if self.eval_problems else test
        self.clipped_streak = self.skipped_streak = 0
        self.no_signal_steps: list[dict] = []   # the current streak of steps without a reward signal
        self.idle_steps: list[dict] = []        # ... of steps with one whose update taught the policy nothing
        self.notes = (precision_notes(self.model, cfg) + component_notes(cfg) + idle_setting_notes(loss.loss, cfg)
                      + on_policy_notes(loss.loss, cfg))
        if dropout:
            self.notes.append(f"note: the base model's dropout is off ({', '.join(dropout)} set to 0): the sampler "
                              "decodes without it, and with it the ratio of pi_theta to pi_old is noise")
        lora = cfg.model.lora.settings()
        if lora is not None and lora.dropout > 0:
            self.notes.append(f"note: model.lora.dropout={lora.dropout:g} stays on in the learner's forward passes "
                              "(the sampler decodes without it): pi_theta / pi_old carries its noise, and a clip "
                              "range acts on it too; 0 keeps the ratio exact at unchanged weights")
        if self.precision_choice is not None:
            self.notes.append(f"note: {self.precision_choice.text()}")

    @classmethod
    def resume(cls, run_dir: str | Path, *, progress: bool | None = None) -> "Trainer":
        """The run in ``run_dir`` at its newest valid checkpoint, with its config.yaml as it is now:
        an edit of a key in ``RESUME_CHANGEABLE`` is applied (and recorded), any other edit is
        refused naming the keys, an incomplete file is refused. Without a checkpoint the run starts
        again from step 0 with config.yaml as it is (its earlier logs are dropped)."""
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise FileNotFoundError(f"resume: {str(run_dir)!r} has no config.yaml; expected a creditrl run directory")
        data = read_saved_config(run_dir / "config.yaml")
        try:
            cfg = resolve_config(config_from_dict(data))
        except ConfigError as err:  # an edit that cannot resolve (e.g. a new estimator with the old one's
            changed_keys_first(run_dir, data)       # options): name the edited keys when that explains it
            raise ConfigError(f"{run_dir / 'config.yaml'}: {err}") from None
        check_complete(run_dir / "config.yaml", data, config_to_dict(cfg))
        skipped: list[str] = []
        weights, state = ckpt.load_latest(run_dir, skipped) if ckpt.list_checkpoints(run_dir) else (None, None)
        if state is not None and "config" in state:
            check_location_edit(cfg.train.output_dir, cfg.train.run_name, state["config"], run_dir)
        cfg = located(cfg, run_dir)
        step = state["step"] if state else 0
        changes = resume_changes(state["config"], config_to_dict(cfg), step) if state and "config" in state else {}
        finished = (run_dir / "final").is_dir() and final_problem(run_dir / "final") is None
        # the newest checkpoint may predate the last step (save_every 0 after an edit): the summary has it
        reached = max(step, finished_steps(run_dir) if finished else 0)
        if finished and reached >= cfg.train.steps:
            raise ValueError(f"resume: the run in {str(run_dir)!r} already finished ({reached}/{cfg.train.steps} "
                             f"steps, final/ complete); nothing to resume (to train on, raise train.steps in its "
                             f"config.yaml)")
        if state is None and finished:    # a restart from step 0 would discard the finished model
            why = f"every checkpoint is damaged: {'; '.join(skipped)}" if skipped else "train.save_every=0"
            raise ValueError(f"resume: the run in {str(run_dir)!r} finished (final/ complete) and kept no checkpoint to "
                             f"continue from ({why}), so resuming would train it again from step 0 and "
                             f"replace final/. To train its model further, start a new run from it "
                             f"(model.name={str(run_dir / 'final')}); to train this run again, use --overwrite")
        trainer = cls(cfg, run_dir, progress=progress)
        if state is not None:
            trainer.load_state(weights, state)
        trainer.record_resume(changes, state, skipped)
        return trainer

    def load_state(self, weights: dict, state: dict) -> None:
        """A checkpoint's weights, optimizer, scheduler, fp16 loss scale, diagnosis window, RNG,
        counters and warning streaks; the learning-rate schedule then follows this run's config (a
        resumed run's edited optim.* keys)."""
        ckpt.load_trainable_state(self.model, weights)
        if state.get("optimizer") is not None:
            self.learner.optimizer.load_state_dict(state["optimizer"])
        self.learner.scheduler.load_state_dict(state["scheduler"])
        self.learner.follow_config()
        if self.learner.noise is not None and state.get("noise_scale") is not None:
            self.learner.noise.load_state_dict(state["noise_scale"])
        if self.learner.entropy_control is not None and state.get("entropy_control") is not None:
            self.learner.entropy_control = EntropyControl(**state["entropy_control"])
        if self.learner.scaler is not None and state.get("grad_scaler") is not None:
            self.learner.scaler.load_state_dict(state["grad_scaler"])
        if self.diagnosis is not None:
            try:
                self.diagnosis.load_state_dict(state["diagnosis"])
            except (KeyError, TypeError, ValueError) as err:   # older checkpoint, diagnosis off then, other rows
                self.notes.append(f"note: the in-training diagnosis window starts empty on resume ({err!s:.120})")
        streaks = state.get("streaks") or {}             # checkpoints written before them: from 0
        self.clipped_streak, self.skipped_streak = streaks.get("clipped", 0), streaks.get("skipped", 0)
        self.no_signal_steps = list(streaks.get("no_signal", []))
        self.idle_steps = list(streaks.get("idle", []))
        ckpt.set_rng_state(state["rng"], self.generator, self.task_rng)
        self.step, self.tokens_total, self.elapsed = state["step"], state["tokens_total"], state["elapsed"]

    def record_resume(self, changes: dict, state: dict | None, skipped: list[str] = ()) -> None:
        """Cut the logs back to the resumed step and record the resume (step, applied config
        changes, damaged checkpoints skipped) in resumes.jsonl; its note is printed when the run
        starts. A restart from step 0 has no checkpoint config to compare with: changes None."""
        run_dir = self.run_dir        # the trackers are rebuilt from these files when the run starts
        for name in ("metrics", "eval", "completions"):
            truncate_jsonl(run_dir / f"{name}.jsonl", self.step if state is not None else -1)
        truncate_jsonl(run_dir / "resumes.jsonl", self.step - 1)
        record = {"step": self.step, "changes": changes if state is not None else None, "checkpoint": state is not None}
        if skipped:
            record["skipped"] = list(skipped)
        with open(run_dir / "resumes.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.notes.append(resume_note(record, run_dir))
        if state is not None and "config" not in state:
            self.notes.append("warning: the checkpoint predates config records, so config.yaml could not be checked "
                              "against what the run trained with")
        problem = final_problem(run_dir / "final")
        if problem:
            self.notes.append(f"note: {run_dir / 'final'} is damaged ({problem}); it is written again when the run ends")

    def save(self) -> Path:
        optimizer = self.learner.optimizer.state_dict() if self.cfg.train.save_optimizer else None
        state = {"optimizer": optimizer, "scheduler": self.learner.scheduler.state_dict(),
                 "rng": ckpt.rng_state(self.generator, self.task_rng),
                 "tokens_total": self.tokens_total, "elapsed": self.elapsed, "config": config_to_dict(self.cfg),
                 "noise_scale": None if self.learner.noise is None else self.learner.noise.state_dict(),
                 "entropy_control": None if self.learner.entropy_control is None else
                 dataclasses.asdict(self.learner.entropy_control),
                 # fp16's loss scale: a resumed run restarting at 2^16 would skip updates the run did not
                 "grad_scaler": None if self.learner.scaler is None else self.learner.scaler.state_dict(),
                 "streaks": {"clipped": self.clipped_streak, "skipped": self.skipped_streak,
                             "no_signal": self.no_signal_steps, "idle": self.idle_steps},
                 "diagnosis": None if self.diagnosis is None else self.diagnosis.state_dict()}
        return ckpt.save_checkpoint(self.run_dir, self.step, ckpt.trainable_state(self.model), state,
                                    self.cfg.train.keep_last)

    def evaluate(self) -> dict:
        c, r = self.cfg, self.cfg.rollout
        start = time.perf_counter()
        with self.precision.autocast(self.model):
            result = evaluate(self.model, self.tokenizer, self.task, self.test_problems, n=self.eval_samples,
                              ks=self.pass_k, temperature=r.temperature, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens, max_tool_tokens=r.max_tool_tokens,
                              seed=c.train.seed, stop_strings=tuple(r.stop),
                              keep_samples=c.logging.completions)
        return {"step": self.step, "tokens_total": self.tokens_total, **result,
                "time_eval": time.perf_counter() - start}

    def sample(self, count: int) -> RolloutBatch:
        """Rollouts of ``count`` new prompts of the task stream, scored (with the overlong penalty)."""
        problems = [self.task.sample(self.task_rng) for _ in range(count)]
        with self.precision.autocast(self.model):
            return generate_rollouts(self.model, self.tokenizer, self.task, problems,
                                     group_size=self.cfg.rollout.group_size, generator=self.generator,
                                     **rollout_kwargs(self.cfg, self.cfg.rollout.max_new_tokens))

    def rollouts(self) -> tuple[RolloutBatch | None, RolloutBatch, dict]:
        """The batch to train on (None when dynamic sampling kept no group), everything sampled for
        the step as one batch, and the dynamic-sampling metrics."""
        r = self.cfg.rollout
        if not r.dynamic_sampling.enabled:
            batch = self.sample(r.prompts_per_step)
            return batch, batch, {}
        d = r.dynamic_sampling
        out = sample_varying_groups(self.sample, r.prompts_per_step, d.signal, d.max_rounds, self.pad_id)
        return out.batch, concat_rollouts(out.sampled, self.pad_id), out.metrics

    def train_step(self) -> tuple[dict, list[dict]]:
        """One step; returns its metrics and its first ``logging.completions`` samples. With dynamic
        sampling the sampling metrics (reward, accuracy, lengths) describe everything sampled, the
        update's the kept groups; a step that kept no group makes no update."""
        t0 = time.perf_counter()
        batch, everything, filtering = self.rollouts()
        t1 = time.perf_counter()
        count = self.cfg.logging.completions
        diagnosed = {} if batch is None else self.diagnose(batch)
        t_update = time.perf_counter()
        if batch is None:
            metrics, samples = ({"skipped_updates": 0, "lr": self.learner.step_schedule()},
                                completion_records(everything, count))
        else:
            update = self.learner.update(batch, self.generator)
            metrics, samples = update.metrics, completion_records(batch, count, update.advantages)
        t2 = time.perf_counter()
        self.step += 1
        self.tokens_total += everything.num_tokens
        metrics = {"step": self.step, "tokens_total": self.tokens_total, **metrics,
                   **(sample_metrics(everything) if filtering else {}), **filtering,
                   **rollout_metrics(everything, self.task), "tokens_per_s": everything.num_tokens / (t2 - t0),
                   "time_rollout": t1 - t0, "time_update": t2 - t_update, **diagnosed}
        return metrics, samples

    def uniform_warning(self, metrics: dict) -> str | None:
        """The warning of a step whose dynamic sampling kept no group (so it made no update)."""
        if metrics.get("kept_groups") != 0:
            return None
        d = self.cfg.rollout.dynamic_sampling
        return (f"warning: step {self.step} made no update: dynamic sampling kept no group in "
                f"{metrics['refill_rounds'] + 1} round(s) (rollout.dynamic_sampling.max_rounds={d.max_rounds}); "
                f"every sampled group's {d.signal} was the same for all its responses (mean reward "
                f"{metrics['reward_mean']:.3g}: the task may be too easy or too hard for the model)")

    def diagnose(self, batch) -> dict[str, float]:
        """On every ``logging.diagnose_every``-th step, the in-training diagnosis of this step's groups
        at the weights that sampled them (``creditrl.runtime.step_diagnosis``); else nothing."""
        every = self.cfg.logging.diagnose_every
        if self.diagnosis is None or (self.step + 1) % every:
            return {}
        with self.precision.autocast(self.model):
            return self.diagnosis.observe(batch)

    def clipped_warning(self, clipped_frac: float) -> str | None:
        """One warning when more than half the responses hit ``rollout.max_new_tokens`` for
        3 steps in a row (their rewards are likely 0: answers cut mid-way)."""
        limit, steps = CLIPPED_WARNING
        self.clipped_streak = self.clipped_streak + 1 if clipped_frac > limit else 0
        if self.clipped_streak != steps:
            return None
        return (f"warning: {clipped_frac:.0%} of this step's responses hit rollout.max_new_tokens="
                f"{self.cfg.rollout.max_new_tokens} without stopping ({steps} steps in a row with more than "
                f"{limit:.0%}); answers are probably being cut: raise rollout.max_new_tokens")

    def check_skipped(self, metrics: dict) -> None:
        """Stop after ``MAX_SKIPPED_STEPS`` consecutive steps with a skipped (non-finite) update."""
        self.skipped_streak = self.skipped_streak + 1 if metrics["skipped_updates"] > 0 else 0
        if self.skipped_streak < MAX_SKIPPED_STEPS:
            return
        stopped = (f"training stopped at step {self.step}: the loss or gradient was NaN/inf for {self.skipped_streak} "
                   f"steps in a row, so those updates were skipped (weights unchanged)")
        error = self.learner.skip_error
        if getattr(error, "term", None):      # policy_loss found the term that made finite inputs non-finite
            raise TrainingStopped(f"{stopped}: {error.term} from finite inputs")
        raise TrainingStopped(
            f"{stopped}. Likely causes: optim.lr={self.cfg.optim.lr} too high for this model, rewards of extreme "
            f"magnitude (this step's mean reward: {metrics.get('reward_mean')}), or a model that produces NaN logits "
            f"(try model.dtype=float32)" + (f". The last non-finite loss: {error}" if error else ""))

    def streak_warnings(self, metrics: dict) -> tuple[str | None, str | None]:
        """The live warnings of a streak of steps without a reward signal, or with one whose update did
        teach the policy nothing (a step without a signal neither breaks nor extends the second). Each
        streak is kept up to one past the warning's length: it warns once per streak."""
        silent = no_signal(metrics)
        self.no_signal_steps = [*self.no_signal_steps, metrics][:NO_SIGNAL_STEPS + 1] if silent else []
        if not silent:
            self.idle_steps = [*self.idle_steps, metrics][:NO_SIGNAL_STEPS + 1] if idle_update(metrics) else []
        return streak_warning(self.no_signal_steps), idle_warning(self.idle_steps, self.cfg.optim)

    def log_eval(self, logger: RunLogger) -> None:
        result = self.evaluate()
        logger.log_completions(self.step, "eval", result.pop("samples", []))
        logger.log("eval", result)

    def run(self) -> Path:
        c = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.precision_choice is not None:       # kept for a resumed run, whose config holds the result
            atomic_write_text(self.run_dir / PRECISION_RECORD, json.dumps(self.precision_choice.record(), indent=2))
        save_config(c, self.run_dir / "config.yaml", comments=precision_comments(self.run_dir))
        logger = RunLogger(self.run_dir, report_to=c.logging.report_to, config=config_to_dict(c),
                           progress=self.progress, total_steps=c.train.steps, start_step=self.step)
        started = time.perf_counter() - self.elapsed
        for note in self.notes:
            logger.message(note)
        if self.truncated_prompts:
            logger.message(f"note: {self.truncated_prompts} prompt(s) are longer than the model's context allows and "
                           f"keep only their last {self.task.max_prompt_tokens} tokens (task.options.truncate_prompts)")
        try:
            if self.step == 0 and not read_jsonl(self.run_dir / "eval.jsonl"):
                self.log_eval(logger)
            while self.step < c.train.steps:
                metrics, samples = self.train_step()
                logger.log_completions(self.step, "train", samples)
                logger.log("metrics", metrics)
                self.check_skipped(metrics)
                for warning in (self.clipped_warning(metrics["clipped_frac"]), self.uniform_warning(metrics),
                                *self.streak_warnings(metrics)):
                    if warning:
                        logger.message(warning)
                self.elapsed = time.perf_counter() - started
                last = self.step == c.train.steps
                if c.train.eval_every and self.step % c.train.eval_every == 0 and not last:
                    self.log_eval(logger)
                if c.train.save_every and (last or self.step % c.train.save_every == 0):
                    self.save()
            evals = read_jsonl(self.run_dir / "eval.jsonl")
            if not evals or evals[-1]["step"] != self.step:
                self.log_eval(logger)
            self.elapsed = time.perf_counter() - started
            self.finish(logger)
        except KeyboardInterrupt:
            print(self.interrupted_text(), file=sys.stderr, flush=True)
            raise
        finally:
            logger.close()
        return self.run_dir

    def interrupted_text(self) -> str:
        """Where an interrupted run stands and how to continue it."""
        found = ckpt.list_checkpoints(self.run_dir)
        resume = f"`creditrl train --resume {self.run_dir}`"
        if not found:
            return (f"interrupted at step {self.step} of {self.cfg.train.steps}; no checkpoint was saved "
                    f"(train.save_every={self.cfg.train.save_every}): {resume} starts again from step 0")
        newest = int(ckpt.PATTERN.search(found[-1].name).group(1))
        steps = f"step {self.step}" if self.step == newest + 1 else f"steps {newest + 1}–{self.step}"
        redo = f", redoing {steps} (their logged rows are replaced)" if self.step > newest else ""
        return (f"interrupted at step {self.step} of {self.cfg.train.steps}; the newest checkpoint is step {newest}: "
                f"{resume} continues from it{redo}")

    def finish(self, logger: RunLogger | None = None) -> dict:
        """final/ (atomic, with a manifest), plots, summary.md/json; a run that had no reward signal
        at any step, or whose updates never taught the policy anything, says so there and in a warning."""
        self.save_final()
        metrics, evals = read_jsonl(self.run_dir / "metrics.jsonl"), read_jsonl(self.run_dir / "eval.jsonl")
        completions = [x for x in read_jsonl(self.run_dir / "completions.jsonl") if x.get("kind") == "train"]
        if self.cfg.logging.plots:
            plots = plot_run(self.run_dir, metrics, evals)
            if logger is not None:
                logger.log_images(plots, self.step)
        c = self.cfg
        title = f"creditrl run: {c.task.name} / {c.model.name} / {c.algorithm.estimator}"
        extra = {"run_dir": str(self.run_dir)}
        warning = learned_nothing(metrics, c.algorithm.estimator) or rewards_taught_nothing(metrics, c.optim)
        if warning:
            extra["warning"] = warning
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        resumes = read_jsonl(self.run_dir / "resumes.jsonl")
        if resumes:
            extra["resumed"] = "; ".join(resume_note(r) for r in resumes)
        if self.truncated_prompts:
            extra["truncated_prompts"] = self.truncated_prompts
        extra["precision"] = next(iter(precision_comments(self.run_dir)),
                                  f"{self.cfg.train.precision}, as train.precision set it (not timed)")
        if self.tiny_cache is not None:
            info = warm_start_info(self.tiny_cache) or {}
            if info:
                done = (f"{info.get('steps')} SFT steps to a sampled mean reward (the accuracy for 0/1 rewards) "
                        f"of {info.get('accuracy', 0):.2f} on training-stream problems, not held out, in "
                        f"{info.get('seconds', 0):.0f}s")
                extra["warm_start"] = (f"loaded from the cache, made by an earlier run ({done})"
                                       if self.warm_start_cached else f"{done}, in this run (cached for later runs)")
        return write_summary(self.run_dir, title=title, metrics=metrics, evals=evals, wall_time=self.elapsed,
                             extra=extra, completions=completions,
                             sections=diagnosis_section(metrics, self.diagnosis.labels if self.diagnosis else []))

    def save_final(self) -> Path:
        """``final/``: the model (LoRA: its adapters) and tokenizer with a manifest (size + SHA-256
        of every file), written into a temporary directory and renamed into place, so a kill
        leaves the previous final/ or none, never a partial one."""
        final = self.run_dir / "final"
        for stale in self.run_dir.glob(".tmp-final-*"):      # a write killed earlier
            shutil.rmtree(stale, ignore_errors=True)
        with atomic_directory(final, replace=True) as tmp, hf_progress(self.progress):
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            write_manifest(tmp, step=self.step)
        return final


def step_diagnosis(model, cfg: Config, learner: Learner) -> StepDiagnosis:
    """The in-training diagnosis of ``logging.diagnose_every`` (the estimator trained, with its options,
    against ``logging.diagnose_estimators`` under the run's loss)."""
    name, options = learner.estimator, learner.estimator_options
    configured = name + (LOO if options.get("leave_one_out") else "")
    rows = compared_rows(configured, options, cfg.logging.diagnose_estimators, options.get("k"))
    return StepDiagnosis(model, rows, configured, learner.loss.loss, temperature=cfg.rollout.temperature,
                         window=cfg.logging.diagnose_window, groups=cfg.rollout.prompts_per_step,
                         seed=cfg.train.seed)


def precision_comments(run_dir: Path) -> list[str]:
    """How ``train.precision`` was chosen (``PRECISION_RECORD``), as config.yaml's comment lines."""
    path = run_dir / PRECISION_RECORD
    if not path.is_file():
        return []
    return [PrecisionChoice.from_record(json.loads(path.read_text())).text()]


def located(cfg: Config, run_dir: Path) -> Config:
    """``cfg`` naming ``run_dir`` as its train.output_dir / run_name (a run directory moved or
    copied elsewhere is resumed where it is, and its config says so)."""
    t, here = cfg.train, run_dir.resolve()
    if run_place(t.output_dir, t.run_name) == here:
        return cfg
    # the saved output_dir where it still names the parent (a copy beside the original): a record of
    # no change; else the parent's absolute path, which names it from any working directory
    output_dir = t.output_dir if run_place(t.output_dir, None) == here.parent else str(here.parent)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, output_dir=output_dir, run_name=here.name))


def changed_keys_first(run_dir: Path, data: dict) -> None:
    """The refusal naming config.yaml's edited keys that cannot change mid-run (``resume_changes``),
    read against the newest checkpoint's config, when there is one; nothing otherwise."""
    if not ckpt.list_checkpoints(run_dir):
        return
    _, state = ckpt.load_latest(run_dir, [])
    if state and "config" in state:
        resume_changes(state["config"], data, state["step"])


def resume_note(record: dict, run_dir: Path | None = None) -> str:
    """A resumes.jsonl record in words."""
    if not record.get("checkpoint"):
        where = f" {run_dir}" if run_dir else ""
        return (f"resume:{where} had no checkpoint (train.save_every=0, or killed before the first one), so the run "
                f"restarted from step 0 with config.yaml as it is now (changes not compared: no checkpoint recorded "
                f"the first start's config); its earlier logs were dropped")
    changes = record.get("changes") or {}
    applied = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
    skipped = (f" (skipped damaged checkpoint(s): {'; '.join(record['skipped'])})" if record.get("skipped") else "")
    return (f"resumed at step {record['step']}{skipped}" +
            (f" with config changes {applied}" if changes else ", config unchanged"))


def final_problem(path: Path) -> str | None:
    """What is wrong with a run's ``final/`` (None when it is absent or complete)."""
    if not path.exists():
        return None
    if (path / MANIFEST).is_file():
        return manifest_problem(path)
    try:
        check_model_dir(path, "final")
    except ModelDirError as err:
        return str(err).removeprefix("final: ")
    return None


def train(cfg: Config, *, run_dir: str | Path | None = None, progress: bool | None = None,
          overwrite: bool = False) -> Path:
    """Train with ``cfg``; returns the run directory. An existing run directory is refused
    (``resume`` continues it) before any work; ``overwrite`` deletes it only once the whole config
    is checked and the model loaded, so a bad input never costs a finished run. A run that fails
    before logging anything (a tracker that cannot start) leaves no directory behind."""
    run_dir = Path(run_dir) if run_dir else Path(cfg.train.output_dir).expanduser() / run_name(cfg)
    created = missing_folders(run_dir)
    check_new_run(run_dir, overwrite=overwrite, inputs=run_inputs(cfg))
    with RunLock(run_dir):
        try:
            trainer = Trainer(copy.deepcopy(cfg), run_dir, progress=progress)
        except BaseException:
            remove_created(created)   # refused before any work: leave no empty folders behind
            raise
        if not created:
            clear_run(run_dir)
        mark_run(run_dir, "train")
        try:
            return trainer.run()
        except BaseException:
            if not any((run_dir / name).is_file() for name in ("metrics.jsonl", "eval.jsonl")):
                clear_run(run_dir)    # failed before logging anything (e.g. a tracker): nothing blocks a re-run
                remove_created(created)
            raise


def remove_created(folders: list[Path]) -> None:
    """Remove what this run created (``missing_folders`` of its directory): the run directory with
    what it holds, then each parent while empty (another run may have started in it)."""
    if folders:
        shutil.rmtree(folders[0], ignore_errors=True)
        remove_empty_folders(folders[1:])


def resume(run_dir: str | Path, *, progress: bool | None = None) -> Path:
    """Continue the interrupted run in ``run_dir`` from its newest valid checkpoint."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():   # before the lock, which would create it
        what = "a file" if run_dir.exists() else "missing"
        raise RunDirError(f"resume: {str(run_dir)!r} is {what}; expected a creditrl run directory")
    with RunLock(run_dir):
        trainer = Trainer.resume(run_dir, progress=progress)
        if run_kind(run_dir) is None:   # a run from before the marker: checked as a run just now
            mark_run(run_dir, "train")
        return trainer.run()
