"""creditrl inside TRL's GRPO (TRL 1.14-1.16): any creditrl estimator and loss term.

``CreditGRPOTrainer`` changes three things in ``GRPOTrainer`` and nothing else:

1. Rollout (``_generate_and_score_completions``): TRL's advantages are replaced by
   ``creditrl.compute_advantages(advantage_estimator, rewards, mask, group)`` [B,T], with TRL's
   prompt groups (``num_generations`` consecutive completions) and the weighted reward sum.
   Estimators that need the energy w_t (otb, otb_isolated, ogb) get it from TRL's fused LM head,
   which returns log pi(y_t), the entropy and log sum_v pi_v^2 in one tiled pass (no [B,T,V]
   logits at all): w_t = 1 - 2 pi(y_t) + sum pi^2 (OTB eq. 7). No forward is added where TRL
   runs one: from its ``old_per_token_logps`` forward when it runs one; else, when the batch is
   trained on in one loss forward per process with the weights that sampled it
   (``steps_per_generation=1``, TRL's default), from that loss forward — the advantages are then
   computed there (gathered over processes). Otherwise one extra fused no-grad forward.
2. Loss (``_compute_loss``): one forward for log-probs and entropies (as TRL), then
   ``creditrl.policy_loss`` with any of creditrl's terms (surrogates, KL, STAPO, GRPO-λ, entropy
   terms, rollout correction, ΔL); TRL's own loss code is not used. The entropy keeps its gradient
   for an entropy bonus; an adaptive one steps its β per optimizer step as TRL's controller does
   (in TRL's attributes ``entropy_coef`` / ``_last_world_entropy``, which its checkpoints keep).
3. Logging: creditrl's loss metrics (``creditrl/spurious_ratio`` ...) and rollout metrics
   (``creditrl/power_proxy``, ``creditrl/energy_mean`` ...) go through TRL's ``_metrics``.

TRL options that have no creditrl counterpart raise at construction (see ``UNSUPPORTED``). TRL's
``scale_rewards`` is ``grpo``'s ``scale`` (refused with other estimators); ``gdpo`` gets each reward
function's values and ``reward_weights`` as its components (TRL's ``multi_objective_aggregation=
"normalize_then_sum"`` asks for it). ``dynamic_sampling`` drops the groups whose signal does not vary
from the loss (DAPO's filter; TRL's batch comes from its dataloader, so they are not refilled: creditrl
train refills). DAPO's soft overlong punishment is TRL's own ``trl.rewards.get_soft_overlong_punishment``,
a reward function (docs/trl.md).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, nanmax, nanmin

from creditrl.utils.validate import check_choice, float_mask
from creditrl.core.estimators import check_group_size, estimator_output, list_estimators
from creditrl.core.estimators.registry import get_estimator
from creditrl.core.groups import GroupIndex, uniform_groups
from creditrl.integrations import check_estimator_options, loss_term_fields
from creditrl.integrations.energy import energy_from_logp
from creditrl.core.losses import EntropyControl, Fields, PolicyLoss, compose, power_proxy
from creditrl.runtime.rollout import RolloutBatch
from creditrl.runtime.sampling import position_ids_from_mask
from creditrl.runtime.step_diagnosis import StepDiagnosis, compared_rows
from creditrl.utils.fused import fused
from creditrl.utils.options import parse_json_field

NO_SIGNAL_BATCHES = 5   # generation batches in a row without a reward signal before the warning (as creditrl train)
# TRL loss_type -> creditrl aggregation (dapo: creditrl normalises per micro-batch, over kept tokens)
AGG_BY_LOSS_TYPE = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                    "dr_grpo": "seq-mean-token-sum-norm"}
# creditrl loss options that GRPOConfig holds under its own names: option -> its value from the config
TRL_NATIVE = {
    "clip_low": lambda args: args.epsilon,
    "clip_high": lambda args: args.epsilon if args.epsilon_high is None else args.epsilon_high,
    "kl_coef": lambda args: args.beta,
    "kl_bias_correction": lambda args: args.use_bias_correction_kl,
    "agg": lambda args: AGG_BY_LOSS_TYPE[args.loss_type],
    "max_len": lambda args: args.max_completion_length if args.loss_type == "dr_grpo" else None,
}
# creditrl loss terms that GRPOConfig switches by its own fields: term -> its options from the config (None = off)
TRL_NATIVE_TERMS = {   # a quantile of 1 keeps every token: off; one above 1 reaches the term's range check
    "top_entropy": lambda args: None if args.top_entropy_quantile == 1.0 else {"quantile": args.top_entropy_quantile},
}
# the GRPOConfig field behind each creditrl option it holds, for errors: TRL's names, not creditrl's
TRL_FIELD_OF = {"clip_low": "epsilon", "clip_high": "epsilon_high", "kl_coef": "beta",
                "quantile": "top_entropy_quantile", "k": "maxk_k"}
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                   "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@contextmanager
def trl_field_names(args):
    """Errors of the options GRPOConfig holds under its own names name its field (``epsilon``), not
    creditrl's option (``clip_low``); ``k`` only where ``maxk_k`` set it."""
    try:
        yield
    except (TypeError, ValueError) as err:
        option, _, rest = str(err).partition(": ")
        field_name = TRL_FIELD_OF.get(option)
        if field_name is None or (field_name == "maxk_k" and args.maxk_k is None):
            raise
        raise type(err)(f"{field_name}: {rest}") from None


@dataclass
class _CreditGRPOFields(GRPOConfig):
    """``GRPOConfig`` plus creditrl's estimator options; the loss options are added from the
    loss-term registry (``CreditGRPOConfig``)."""

    advantage_estimator: str = field(default="grpo", metadata={"help": "Any name of creditrl.list_estimators()."})
    estimator_options: dict | str | None = field(default=None, metadata={
        "help": "The estimator's options (dict or JSON), checked against what it declares, e.g. "
                "{\"k\": 4, \"normalize\": \"std\"} for maxpo."})
    maxk_k: int | None = field(default=None, metadata={"help": "Alias of estimator_options={\"k\": K}."})
    log_energy_metrics: bool = field(
        default=False, metadata={"help": "Compute the energy for estimators that do not need it, for the "
                                         "variance-proxy metric (one extra no-grad forward per generation)."})
    dynamic_sampling: bool = field(
        default=False, metadata={"help": "DAPO's dynamic sampling filter: the groups whose dynamic_sampling_signal "
                                         "is the same for every completion leave the loss (their completion mask is "
                                         "zeroed, so the loss counts the kept groups only; batch-level estimators "
                                         "see the kept groups only); logged as creditrl/filtered_frac. Not refilled: "
                                         "TRL's batch comes from its dataloader (creditrl train refills)."})
    dynamic_sampling_signal: str = field(
        default="reward", metadata={"help": "What must vary within a group: `reward` (the weighted sum of the "
                                            "reward functions) or one reward function's name (e.g. the accuracy "
                                            "reward when another one shapes length: filtering on a shaped score "
                                            "is verl-recipe #125's pitfall)."})

    def __post_init__(self):
        super().__post_init__()
        check_choice("advantage_estimator", self.advantage_estimator, list_estimators())
        if self.loss_type in ("cispo", "sapo"):
            raise ValueError(f"loss_type: CreditGRPOTrainer takes the surrogate from creditrl's loss terms: set "
                             f"{self.loss_type}=True (verl's {self.loss_type}) and a loss_type among "
                             f"{list(AGG_BY_LOSS_TYPE)} for the aggregation; got loss_type={self.loss_type!r}")
        check_choice("loss_type", self.loss_type, list(AGG_BY_LOSS_TYPE))
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected a value > 0 (GRPO samples its completions, and the "
                             f"log-probs are taken at this temperature), got {self.temperature!r}")
        self.estimator_options = parse_json_field("estimator_options", self.estimator_options, dict)
        self.loss_terms = parse_json_field("loss_terms", self.loss_terms, list)
        if self.maxk_k is not None and "k" in (self.estimator_options or {}):
            raise ValueError(f"maxk_k: an alias of estimator_options['k'], both set ({self.maxk_k} and "
                             f"{self.estimator_options['k']}); set one")
        self.check_trl_aggregation()
        with trl_field_names(self):
            check_estimator_options(self.advantage_estimator, self.estimator_kwargs(), "estimator_options")
            for key in ("num_generations", "num_generations_eval"):   # each mode's group size, now, not at step 1
                if getattr(self, key, None) is not None:
                    check_group_size(self.advantage_estimator, self.estimator_kwargs(), getattr(self, key), key=key)
            terms = self.policy_loss_terms()                               # also checks every loss option now
        if "mask_truncated" in terms:
            raise ValueError("mask_truncated: TRL masks truncated completions itself, before the loss: set "
                             "mask_truncated_completions=True instead of creditrl's mask_truncated")

    def check_trl_aggregation(self) -> None:
        """TRL's own advantage settings, where creditrl's estimator replaces TRL's: ``scale_rewards`` is
        grpo's ``scale``; ``multi_objective_aggregation="normalize_then_sum"`` is ``gdpo``."""
        scale = self.scale_rewards
        given = (self.estimator_options or {}).get("scale")
        if scale != "group" and self.advantage_estimator != "grpo":
            raise ValueError(f"scale_rewards: TRL's reward scaling is grpo's `scale` option, and "
                             f"advantage_estimator={self.advantage_estimator!r} has none; expected 'group' (the "
                             f"default), got {scale!r}")
        if scale != "group" and given is not None and given != scale:
            raise ValueError(f"scale_rewards: {scale!r} and estimator_options['scale']={given!r} disagree; set one")
        if self.multi_objective_aggregation != "sum_then_normalize" and self.advantage_estimator != "gdpo":
            raise ValueError(f"multi_objective_aggregation: {self.multi_objective_aggregation!r} normalises each "
                             f"reward function before the sum, which is advantage_estimator='gdpo'; expected "
                             f"'sum_then_normalize' with {self.advantage_estimator!r}")

    def estimator_kwargs(self) -> dict:
        options = dict(self.estimator_options or {})
        if self.maxk_k is not None:
            options["k"] = self.maxk_k
        if self.advantage_estimator == "grpo" and self.scale_rewards != "group":
            options["scale"] = self.scale_rewards
        return options

    def policy_loss_terms(self) -> dict:
        """The terms of ``composed_loss`` (name -> options)."""
        return self.composed_loss().chosen

    def composed_loss(self) -> PolicyLoss:
        """The ``PolicyLoss`` of these settings (TRL's own names mapped by ``TRL_NATIVE``)."""
        return compose(Fields(lambda key: getattr(self, key, None),
                              native={name: value(self) for name, value in TRL_NATIVE.items()},
                              native_terms={name: value(self) for name, value in TRL_NATIVE_TERMS.items()}))


CreditGRPOConfig = dataclasses.make_dataclass(
    "CreditGRPOConfig", loss_term_fields(native=TRL_NATIVE, native_terms=TRL_NATIVE_TERMS), bases=(_CreditGRPOFields,))
CreditGRPOConfig.__module__ = __name__
CreditGRPOConfig.__doc__ = (
    "``GRPOConfig`` plus creditrl's options: the estimator (``advantage_estimator``, "
    "``estimator_options``) and every loss term's options, generated from the loss-term registry: the "
    "fields of the flat terms TRL has no name for (``clip_c``, ``kl_estimator``, ``rollout_correction``, "
    "``rollout_cap``), ``stapo`` / ``stapo_*``, ``trace`` / ``trace_*``, the surrogates (``cispo``, "
    "``sapo`` / ``sapo_*``, ``gspo``, ...), ``entropy_bonus`` / ``entropy_bonus_*``, ``delta_l_norm`` and "
    "``loss_terms``; TRL's own ``top_entropy_quantile`` and ``use_bias_correction_kl`` drive creditrl's "
    "``top_entropy`` term and ``kl_bias_correction`` (docs/trl.md).")


# GRPOConfig settings whose effect lives in TRL's loss code, which CreditGRPOTrainer replaces.
UNSUPPORTED = {
    "importance_sampling_level": ("token", "TRL's sequence-level ratio (creditrl's: gspo=True, verl's GSPO-token)"),
    "off_policy_mask_threshold": (None, "off-policy sequence masking"),
    "delta": (None, "two-sided clipping (use clip_c)"),
    "entropy_coef": (0.0, "TRL's entropy bonus (creditrl's: entropy_bonus_coef)"),
    "use_adaptive_entropy": (False, "TRL's adaptive entropy control (creditrl's: entropy_bonus_adaptive=True)"),
}


class CreditGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages, loss and metrics come from creditrl (module docstring).

    ``last_rollout`` holds the tensors of the latest generation batch on this process (rewards
    and group ids of all processes; mask, energy, advantages of this process), for inspection.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, CreditGRPOConfig):
            raise TypeError(f"args: expected a CreditGRPOConfig, got {type(self.args).__name__}")
        for name, (default, what) in UNSUPPORTED.items():
            if getattr(self.args, name) != default:
                raise ValueError(f"{name}: CreditGRPOTrainer computes the loss with creditrl, which does not "
                                 f"implement {what}; expected {default!r}, got {getattr(self.args, name)!r}")
        if self.args.rollout_correction is not None and not self.use_vllm and self.rollout_func is None:
            raise ValueError(f"rollout_correction: {self.args.rollout_correction!r} corrects for the sampler's "
                             "log-probs, which TRL returns only from vLLM; set use_vllm=True (or "
                             "rollout_correction=None), got use_vllm=False")
        if self.args.rollout_correction is not None and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError("rollout_correction: set vllm_importance_sampling_correction=False to use "
                             f"creditrl's {self.args.rollout_correction!r} instead of TRL's correction")
        self.estimator = self.args.advantage_estimator
        self.estimator_kwargs = self.args.estimator_kwargs()
        self.filter_signal = self._check_dynamic_sampling() if self.args.dynamic_sampling else None
        self.wants_energy = get_estimator(self.estimator).needs_energy or self.args.log_energy_metrics
        self.policy_loss = self.args.composed_loss()
        bonus = self.policy_loss.options_of("entropy_bonus")
        self.entropy_options = bonus if bonus is not None and bonus.adaptive else None
        if self.entropy_options is not None:   # kept in TRL's own attributes: its checkpoints save and restore them
            self.use_adaptive_entropy, self.entropy_coef, self._last_world_entropy = True, bonus.coef, math.inf
        self._entropy_window: Tensor | None = None
        self.last_rollout: dict[str, Tensor] | None = None
        self._flat_batches = 0                          # generation batches in a row with every advantage 0
        self._reward_capture: list[Tensor] | None = None
        # Re-patch TRL's fused LM head so the same tiled pass also returns log sum pi^2.
        self._policy_module = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_lm_head(self._policy_module, temperature=self.temperature,
                          cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy", "log_sum_sq_probs"))

    def _check_dynamic_sampling(self) -> int | None:
        """The column of the reward function ``dynamic_sampling_signal`` names (None: the weighted sum),
        checked before training: filtering the weighted sum while TRL's soft overlong punishment is one
        of its terms would keep groups that differ only in length (verl-recipe #125)."""
        signal, names = self.args.dynamic_sampling_signal, list(self.reward_func_names)
        if signal != "reward" and signal not in names:
            raise ValueError(f"dynamic_sampling_signal: expected 'reward' or a reward function's name {names}, "
                             f"got {signal!r}")
        shaping = [n for f, n in zip(self.reward_funcs, names) if type(f).__name__ == "_SoftOverlongPunishment"]
        if signal == "reward" and shaping:
            raise ValueError(f"dynamic_sampling_signal: 'reward' sums {shaping}, a length shaping, so groups that "
                             f"differ only in length would count as informative (verl-recipe #125); name the "
                             f"correctness reward instead, one of {[n for n in names if n not in shaping]}")
        return None if signal == "reward" else names.index(signal)

    def _filtered_rows(self, mode: str, rewards: Tensor, rewards_per_func: Tensor, group: Tensor) -> Tensor | None:
        """[B_all] bool rows kept by dynamic sampling (train mode only), logging the filtered fraction."""
        if not self.args.dynamic_sampling or mode != "train":
            return None
        signal = rewards if self.filter_signal is None else rewards_per_func[:, self.filter_signal]
        uniform = uniform_groups(signal.double(), group)
        self._log_creditrl(mode, {"filtered_frac": float(uniform.float().mean())})
        if bool(uniform.all()):
            warnings.warn(f"dynamic_sampling: every group of this generation batch had the same "
                          f"{self.args.dynamic_sampling_signal} for all its completions, so its loss is 0; TRL still "
                          f"takes the optimizer step (Adam's momentum moves the weights) and cannot refill the batch",
                          stacklevel=2)
        return ~uniform[GroupIndex.from_ids(group).dense]

    # ------------------------------------------------------------------ rollout
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards [all processes' completions, reward funcs], also handed to the
        ``_generate_and_score_completions`` call in progress (TRL's output carries no rewards)."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._reward_capture is not None:
            self._reward_capture.append(rewards_per_func)
        return rewards_per_func

    @contextmanager
    def _capturing_rewards(self):
        """Scope of one generation: the rewards TRL computes inside it, then nothing is kept."""
        self._reward_capture = captured = []
        try:
            yield captured
        finally:
            self._reward_capture = None

    @contextmanager
    def _capture_log_sum_p2(self):
        """Collect ``log_sum_sq_probs`` of every fused forward of the policy (forward hook)."""
        chunks: list[Tensor] = []

        def hook(module, args, output):
            value = getattr(output, "log_sum_sq_probs", None)
            if value is not None:
                chunks.append(value)

        handle = self._policy_module.register_forward_hook(hook)
        try:
            yield chunks
        finally:
            handle.remove()

    @torch.no_grad()
    def _rollout_energy(self, output: dict, batch_size: int) -> Tensor:
        """Energy w_t [B,T] of the completions under the current (rollout) policy."""
        completion_ids = output["completion_ids"]
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        steps = completion_ids.size(1)
        with self._capture_log_sum_p2() as chunks:
            logp, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, steps, batch_size=batch_size,
                **{k: output[k] for k in MULTIMODAL_KEYS if k in output})
        return energy_from_logp(logp, torch.cat(chunks, dim=0)[:, -steps:].exp())

    @staticmethod
    def _energy_from_old_logps(output: dict, chunks: list[Tensor]) -> Tensor | None:
        """Energy from TRL's own ``old_per_token_logps`` forward (the first policy forward of a
        generation, under the rollout policy), whose fused head also returned log Σπ²; None when
        TRL ran no such forward (then ``_rollout_energy`` runs one)."""
        old = output.get("old_per_token_logps")
        if old is None:
            return None
        taken, rows = [], 0
        for chunk in chunks:
            if rows >= old.shape[0]:
                break
            taken.append(chunk)
            rows += chunk.shape[0]
        if rows != old.shape[0]:
            return None
        return energy_from_logp(old, torch.cat(taken, dim=0)[:, -old.shape[1]:].exp())

    def _gather_rows(self, x: Tensor) -> Tensor:
        """[B_local, T_local] of every process -> [B_all, T_max] (zero-padded on the right); ``x``
        itself in a single process (nothing to pad or gather)."""
        if self.accelerator.num_processes == 1:
            return x
        if x.dtype == torch.bool:                 # collectives move numbers
            return self._gather_rows(x.int()).bool()
        return self.accelerator.gather(self.accelerator.pad_across_processes(x, dim=1, pad_index=0))

    def _generate_and_score_completions(self, inputs):
        with self._capturing_rewards() as captured, self._capture_log_sum_p2() as sum_p2_chunks:
            output = super()._generate_and_score_completions(inputs)
        if len(captured) != 1:
            raise RuntimeError(f"CreditGRPOTrainer: expected TRL to compute rewards once per generation, got "
                               f"{len(captured)} calls of _calculate_rewards (unsupported TRL version?)")
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        mask = output["completion_mask"] if "tool_mask" not in output else output["completion_mask"] * output["tool_mask"]
        mask = mask.bool()
        local_rows, steps = mask.shape

        rewards_per_func = captured[0]                   # [all processes' completions, reward funcs]
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)[None]).nansum(dim=1)
        group = torch.arange(rewards.numel(), device=rewards.device) // group_size
        scored = ~torch.isnan(rewards_per_func).all(dim=1)
        scorable = scored
        kept = self._filtered_rows(mode, rewards, rewards_per_func, group)
        if kept is not None:                             # out of the loss: its mask is zeroed
            start = self.accelerator.process_index * local_rows
            output["completion_mask"] = output["completion_mask"] * kept[start:start + local_rows, None]
            mask = mask & kept[start:start + local_rows, None]
            scorable = scorable & kept
        components = rewards_per_func if get_estimator(self.estimator).reward_components else None
        if not bool(scored.all()):  # every reward func returned None: group-mean reward, advantage 0
            groups = GroupIndex.from_ids(group)
            weight = scored.float()
            mean = groups.gather(groups.sum(rewards * weight) / groups.sum(weight).clamp(min=1))
            rewards = torch.where(scored, rewards, mean)

        energy = None
        if self.wants_energy:
            energy = self._energy_from_old_logps(output, sum_p2_chunks)
            if energy is None and mode == "train" and self.args.steps_per_generation == 1:
                # TRL trains on this batch with the weights that sampled it, in one loss forward per
                # process: that forward's fused head gives the energy, so advantages wait for it
                start = self.accelerator.process_index * local_rows
                rows = slice(start, start + local_rows)
                output.update(creditrl_rewards=rewards[rows], creditrl_group=group[rows],
                              creditrl_scorable=scorable[rows].long(),
                              advantages=torch.zeros(local_rows, steps, device=mask.device))
                if components is not None:
                    output["creditrl_components"] = components[rows]
                return output
            if energy is None:  # no forward of TRL's to reuse: one fused no-grad pass
                batch_size = (self.args.per_device_train_batch_size if mode == "train"
                              else self.args.per_device_eval_batch_size)
                energy = self._rollout_energy(output, batch_size)
            energy = torch.where(mask, energy, 0.0)
        output["advantages"] = self._advantages(mode, rewards, group, scorable, mask, energy, components)
        return output

    def _advantages(self, mode: str, rewards: Tensor, group: Tensor, scorable: Tensor, mask: Tensor,
                    energy: Tensor | None, components: Tensor | None = None) -> Tensor:
        """creditrl's advantages of this process's rows [B_local, T]: rewards, group, scorable are
        [B_all] for every process in process order; mask, energy (0 off the mask) are this
        process's [B_local, T] (gathered here, zero-padded to the longest completion); components
        [B_all, reward funcs] for gdpo. Rows not scorable (or filtered out) stay out of the estimator.
        Logs the rollout metrics (``rollout_metrics``; from the per-row values when the estimator
        gives one per row), one host read."""
        local_rows, steps = mask.shape
        scorable, all_mask = scorable.bool(), self._gather_rows(mask)
        everything = bool(scorable.all())              # one host read, for the mask and the metrics
        if not everything:
            all_mask = all_mask & scorable[:, None]
        all_energy = None if energy is None else self._gather_rows(energy)
        estimator_energy = all_energy if get_estimator(self.estimator).needs_energy else None
        # the previous batch's tensors are dead now: freed before this batch's [B,T] advantages are
        # allocated, so the allocator reuses their memory instead of faulting in fresh pages
        self.last_rollout = {"components": components}
        advantages, per_row, counts = self._estimate(rewards, all_mask, group, scorable, estimator_energy, components,
                                                     everything=everything)
        if self.args.log_completions:
            self._log_completion_advantages(advantages, all_mask, per_row)
        local_scorable = scorable
        if self.accelerator.num_processes > 1:          # this process's rows (views cost microseconds each)
            local = slice(self.accelerator.process_index * local_rows, (self.accelerator.process_index + 1) * local_rows)
            advantages, local_scorable = advantages[local, :steps], scorable[local]
            per_row = None if per_row is None else per_row[local]
            counts = None if counts is None else counts[local]
        if per_row is not None and not everything:
            # rows not scorable are in the estimator with no valid token: their advantages are 0,
            # whatever value the estimator gave them, and the local mask's counts are the ones to use
            per_row = torch.where(local_scorable, per_row, 0.0)
        logged = self._log_creditrl(mode, rollout_metrics(advantages, energy, mask, per_row, counts))
        if mode == "train":
            self._watch_reward_signal(logged["advantage_abs_mean"], scorable, all_mask)
        self.last_rollout.update(rewards=rewards, group=group, mask=mask, energy=energy, advantages=advantages,
                                 estimator_mask=all_mask)
        return advantages

    def _log_completion_advantages(self, advantages: Tensor, mask: Tensor, per_row: Tensor | None) -> None:
        """TRL's completions table (``log_completions``) shows creditrl's advantage of each completion, the
        estimator's value for a sequence-level one, else the mean over its trained tokens, in place of the
        GRPO z-score TRL logged for these completions (advantages, mask [B_all, T]; per_row [B_all])."""
        means = per_row if per_row is not None else advantages.sum(1) / mask.sum(1).clamp(min=1)
        means = torch.where(mask.any(1), means, 0.0).tolist()     # rows out of the loss trained on 0
        logged = self._logs["advantages"]
        for _ in range(min(len(means), len(logged))):
            logged.pop()
        logged.extend(means)

    def _estimate(self, rewards: Tensor, mask: Tensor, group: Tensor, scored: Tensor, energy: Tensor | None,
                  components: Tensor | None, everything: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(``compute_advantages`` [B_all, T], the per-row values [B_all] of an estimator that gives one
        per row, else None, and the valid tokens per row of ``mask`` where ``everything``: every row ``scored``),
        with the reward functions as gdpo's components. Otherwise only the ``scored`` rows are estimated
        (the others get 0): a completion no reward function scored, or a group dynamic sampling filtered
        out, is no member of its group's statistics (TRL's nanmean/nanstd leave an unscored one out too)."""
        rows = None if everything else torch.nonzero(scored).flatten()
        parts = {} if components is None else dict(components=components,
                                                   component_weights=self.reward_weights.to(components.device))
        if rows is None:
            out, batch = estimator_output(self.estimator, rewards=rewards, mask=mask, group=group, energy=energy,
                                          **parts, **self.estimator_kwargs)
            # the batch's own count: free where the estimator read it (opo, otb, reinforce_plus_plus*),
            # else one integer pass over the mask's bytes, before a [B] result is broadcast over them
            counts = batch.lengths
            return batch.on_tokens(out, last_use=True), (out if out.dim() == 1 else None), counts
        advantages = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        per_row = torch.zeros(mask.shape[0], dtype=torch.float32, device=mask.device)
        if not rows.numel():
            return advantages, per_row, None
        parts = {k: v[rows] if k == "components" else v for k, v in parts.items()}
        out, batch = estimator_output(self.estimator, rewards=rewards[rows], mask=mask[rows], group=group[rows],
                                      energy=None if energy is None else energy[rows], **parts,
                                      **self.estimator_kwargs)
        advantages[rows] = batch.on_tokens(out, last_use=True)
        if out.dim() != 1:
            return advantages, None, None
        per_row[rows] = out
        return advantages, per_row, None

    # ------------------------------------------------------------------ loss
    def _compute_loss(self, model, inputs):
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        deferred = "creditrl_group" in inputs       # advantages wait for this forward's energy
        with self._capture_log_sum_p2() as sum_p2_chunks:
            logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled, **{k: inputs.get(k) for k in MULTIMODAL_KEYS})
        old_logp = inputs.get("old_per_token_logps")
        advantages = inputs["advantages"]
        if deferred:
            with torch.no_grad():
                steps = completion_ids.size(1)
                log_sum_p2 = torch.cat(sum_p2_chunks, dim=0)[:, -steps:]
                energy = torch.where(mask.bool(), energy_from_logp(logp, log_sum_p2.exp()), 0.0)
                gather = self.accelerator.gather
                components = inputs.get("creditrl_components")
                advantages = self._advantages(
                    "train", gather(inputs["creditrl_rewards"]), gather(inputs["creditrl_group"]),
                    gather(inputs["creditrl_scorable"]), mask.bool(), energy,
                    None if components is None else gather(components))
        weights = inputs.get("importance_sampling_ratio")  # TRL's vLLM correction: a data weight of the surrogate
        loss_fn = self._step_policy_loss()
        loss, metrics = loss_fn(
            logp, logp.detach() if old_logp is None else old_logp, advantages, mask.bool(),
            ref_logp=inputs.get("ref_per_token_logps"),
            rollout_logp=inputs.get("sampling_per_token_logps") if self.args.rollout_correction else None,
            entropy=entropy if loss_fn.entropy_grad else entropy.detach(),
            weights=None if weights is None else weights.expand_as(logp))
        mode = "train" if self.model.training else "eval"
        if self.entropy_options is not None and mode == "train":
            self._observe_entropy(metrics, mask)
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss / normalizer
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
        valid = mask.bool()
        # one masked sum for both entropies: creditrl's is this process's, TRL's is reduced over processes
        entropy_totals = torch.stack([(entropy.detach() * valid).sum(dtype=torch.float32), valid.sum().float()])
        metrics["entropy"] = (entropy_totals[0] / entropy_totals[1].clamp(min=1.0)).item()
        self._log_creditrl(mode, metrics)
        self._log_trl_metrics(mode, logp.detach(), logp.detach() if old_logp is None else old_logp,
                              inputs.get("ref_per_token_logps"), advantages, entropy_totals, valid)
        return loss

    @torch.no_grad()
    def _log_trl_metrics(self, mode: str, logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None,
                         advantages: Tensor, entropy_totals: Tensor, mask: Tensor) -> None:
        """TRL's own loss metrics, under TRL's names and definitions (``GRPOTrainer._compute_loss``), so
        dashboards built on plain GRPOTrainer keep working: ``entropy``, ``kl`` (beta != 0, k3 to the
        reference, times the ratio under ``use_bias_correction_kl``) and ``clip_ratio/*`` (the ratio
        outside [1 - epsilon, 1 + epsilon_high] on the side where the advantage's sign makes the clip
        bind). creditrl's own are under ``creditrl/*``. ``entropy_totals``: this process's masked
        entropy sum and token count, [2]."""
        mask = mask.float()

        def global_mean(totals: Tensor) -> float:
            totals = self.accelerator.reduce(totals, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def global_masked_mean(x: Tensor) -> float:
            return global_mean(torch.stack([(x * mask).sum(), mask.sum()]))

        def masked_seq_mean(x: Tensor) -> Tensor:        # NaN for an empty row, skipped by nanmin / nanmax
            return (x * mask).sum(-1) / mask.sum(-1)

        logged, ratio = self._metrics[mode], torch.exp(logp - old_logp)
        if self.beta != 0.0 and ref_logp is not None:
            gap = ref_logp - logp
            kl = torch.exp(gap) - gap - 1
            logged["kl"].append(global_masked_mean(kl * ratio if self.args.use_bias_correction_kl else kl))
        logged["entropy"].append(global_mean(entropy_totals))
        low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
        logged["clip_ratio/low_mean"].append(global_masked_mean(low))
        logged["clip_ratio/high_mean"].append(global_masked_mean(high))
        logged["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
        logged["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
        logged["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())

    def _step_policy_loss(self) -> PolicyLoss:
        """The loss of this micro-batch: with an adaptive entropy bonus, the β its controller applies
        in the current accumulation window (TRL's rule, ``creditrl.core.losses.entropy``)."""
        if self.entropy_options is None:
            return self.policy_loss
        control = EntropyControl(self.entropy_coef, self._last_world_entropy)
        return self.policy_loss.with_options("entropy_bonus", control.loss_options(self.entropy_options))

    def _observe_entropy(self, metrics: dict[str, float], mask: Tensor) -> None:
        """Sum the entropy over the bonus's tokens through the accumulation window; at its end
        (``sync_gradients``) update the controller with the token mean over every process, as TRL."""
        kept = metrics["kept_frac"] * float(mask.sum())
        stats = torch.tensor([metrics["bonus_entropy"] * kept, kept], device=self.accelerator.device)
        self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
        if self.accelerator.sync_gradients:
            total = self.accelerator.reduce(self._entropy_window, reduction="sum")
            entropy = float(total[0] / total[1]) if float(total[1]) > 0 else math.nan
            control = EntropyControl(self.entropy_coef, self._last_world_entropy).update(entropy, self.entropy_options)
            self.entropy_coef, self._last_world_entropy = control.coef, control.last_entropy
            self._entropy_window = None

    def _log_creditrl(self, mode: str, metrics: dict[str, float]) -> dict[str, float]:
        """Average ``metrics`` over processes (one gather), queue them in TRL's logger, return them."""
        keys = sorted(metrics)
        if self.accelerator.num_processes == 1:         # nothing to average: no tensor round trip
            averaged = {k: metrics[k] for k in keys}
        else:
            values = torch.tensor([[metrics[k] for k in keys]], dtype=torch.float32, device=self.accelerator.device)
            averaged = dict(zip(keys, self.accelerator.gather(values).mean(dim=0).tolist()))
        for key, value in averaged.items():
            self._metrics[mode][f"creditrl/{key}"].append(value)
        return averaged

    def _watch_reward_signal(self, advantage_abs_mean: float, scorable: Tensor, mask: Tensor) -> None:
        """Warn (main process) when ``NO_SIGNAL_BATCHES`` generation batches in a row had every advantage
        0 over all processes, naming why for the last: such a run learns nothing from its task, and
        TRL says so only in a metric. ``scorable`` [B_all], ``mask`` [B_all, T]: the estimator's."""
        self._flat_batches = self._flat_batches + 1 if advantage_abs_mean == 0 else 0
        if self._flat_batches != NO_SIGNAL_BATCHES or not self.accelerator.is_main_process:
            return
        if not bool(scorable.any()):
            why = ("no completion was scored or kept (every reward function returned None, or dynamic sampling "
                   "filtered every group)")
        elif not bool(mask.any()):
            why = "no completion token was in the loss (e.g. every completion truncated and masked)"
        else:
            why = (f"the rewards held no difference for {self.estimator!r} to learn from (with a group baseline: "
                   "each group's rewards were equal, TRL's frac_reward_zero_std = 1)")
        warnings.warn(
            f"creditrl: every advantage was 0 in {NO_SIGNAL_BATCHES} generation batches in a row (global step "
            f"{self.state.global_step}): {why}, so the policy gradient has no reward part and the model learns "
            "nothing from its task.", RuntimeWarning, stacklevel=2)


@fused
def _energy_sums(advantages: Tensor, energy: Tensor) -> Tensor:
    """[Σ|A|, Σ w, Σ A² w] of [B,T] float tensors, in one pass once compiled. Each row's sums first:
    inductor parallelises a CPU reduction over its outer axis, and the three whole-tensor reductions
    of the flat tensors ran 1.8x slower at B = 1,024, T = 4,096 (the bool mask's count stays out: a
    bool load in the same loop tripled its time on a CPU)."""
    return torch.stack([advantages.abs().sum(1), energy.sum(1), (advantages * energy * advantages).sum(1)]).sum(1)


@fused
def _abs_sum(advantages: Tensor) -> Tensor:
    """Σ|A| of a [B,T] float tensor, [1], in one pass once compiled (eager ``abs`` writes a [B,T] copy
    first: 1.5-1.7 ms at B = 1,024, T = 4,096 on the 2-core dev CPU, where a plain sum takes 0.5-0.6);
    each row's sum first, as ``_energy_sums``."""
    return advantages.abs().sum(1).sum().reshape(1)


def rollout_metrics(advantages: Tensor, energy: Tensor | None, mask: Tensor, per_row: Tensor | None = None,
                    counts: Tensor | None = None) -> dict[str, float]:
    """The hook's logged metrics of advantages [B,T] (exactly 0 off the bool ``mask``, the output
    contract): ``advantage_abs_mean`` = Σ|A| / tokens and, with energies [B,T] (0 off the mask),
    ``energy_mean`` = Σ w / tokens and ``power_proxy`` (``power_proxy``: (1/B) Σ_i Σ_t A_t² w_t),
    with one host read.

    ``counts``: [B] the mask's row counts n_i, when the caller has them (else one pass over the mask).
    ``per_row``: [B] the estimator's value a_i of each row, when it gives one per row (A = a_i on
    row i's valid tokens). The sums then need no pass over A: Σ|A| = Σ_i |a_i| n_i and
    Σ_t A_t² w_t = a_i² Σ_t w_t. Otherwise the energy's sums come from one fused pass over A and w (``_energy_sums``)."""
    if per_row is not None:
        values = _per_row_stats(per_row, float_mask(mask).sum(1) if counts is None else counts, energy)
    else:
        stats = [torch.count_nonzero(mask) if counts is None else counts.sum()]
        if energy is None:             # no graph for an empty batch (see below)
            stats.append(advantages.new_zeros(()) if advantages.numel() == 0 else
                         _abs_sum(advantages.detach().contiguous())[0])
        else:
            # an empty batch sums to 0 without a graph of its own: sizes 0 specialise a compiled trace, and
            # with sizes 1 they would take dynamo past its recompile limit (later shapes then run eagerly)
            sums = advantages.new_zeros(3) if advantages.numel() == 0 else \
                _energy_sums(advantages.detach().contiguous(), energy.detach().to(advantages.dtype).contiguous())
            stats += [sums[0], sums[1], sums[2] / max(advantages.shape[0], 1)]
        values = torch.stack([x.to(torch.float64) for x in stats]).tolist()
    count = max(values[0], 1.0)
    metrics = {"advantage_abs_mean": values[1] / count}
    if energy is not None:
        metrics["energy_mean"] = values[2] / count
        # non-finite: a masked NaN/inf energy, or an overflow; ``power_proxy`` names the input or masks it
        metrics["power_proxy"] = values[3] if math.isfinite(values[3]) else power_proxy(advantages, energy, mask)
    return metrics


NUMPY_DTYPES = (torch.float32, torch.float64, torch.int64)


def _per_row_stats(per_row: Tensor, counts: Tensor, energy: Tensor | None) -> list[float]:
    """[Σ n_i, Σ |a_i| n_i] (and [Σ_i W_i, (1/B) Σ_i a_i² W_i], W_i = Σ_t w_t, with energies) in float64
    from the [B] columns, read in one host transfer and summed on the host: B values, where each
    of torch's small ops costs more than numpy's whole sum."""
    columns = [per_row, counts] + ([] if energy is None else [energy.sum(1)])
    if per_row.device.type == "cpu":                # numpy reads them where they are: no stacked copy
        host = [(x.detach() if x.dtype in NUMPY_DTYPES else x.detach().to(torch.float64)).numpy().astype(np.float64)
                for x in columns]
    else:
        host = torch.stack([x.detach().to(torch.float64) for x in columns]).cpu().numpy()
    values, counts = host[0], host[1]
    stats = [counts.sum(), np.abs(values) @ counts]
    if energy is not None:
        stats += [host[2].sum(), np.square(values) @ host[2] / max(values.size, 1)]
    return [float(x) for x in stats]


# ---------------------------------------------------------------------- in-training diagnosis


def trl_setting(trainer) -> tuple[str, dict, PolicyLoss]:
    """(estimator label, its options, the policy loss) a GRPOTrainer trains with: CreditGRPOTrainer's
    own; plain GRPOTrainer's ``scale_rewards`` group -> ``grpo``, none -> ``dr_grpo``, and its
    ``loss_type``, ``epsilon``/``epsilon_high`` and ``beta`` as creditrl's aggregation, clip and KL."""
    if isinstance(trainer, CreditGRPOTrainer):
        options = dict(trainer.estimator_kwargs)
        label = trainer.estimator + ("+loo" if options.get("leave_one_out") else "")
        return label, options, trainer.policy_loss
    args = trainer.args
    estimators = {"group": "grpo", True: "grpo", "none": "dr_grpo", False: "dr_grpo"}
    if args.scale_rewards not in estimators:
        raise ValueError(f"scale_rewards: {args.scale_rewards!r} normalises by the whole batch's reward std, which "
                         f"no creditrl estimator reproduces; in-training diagnosis needs 'group' or 'none'")
    if args.loss_type not in AGG_BY_LOSS_TYPE:
        raise ValueError(f"loss_type: in-training diagnosis measures {list(AGG_BY_LOSS_TYPE)}, got {args.loss_type!r}")
    native = {name: value(args) for name, value in TRL_NATIVE.items()}
    return estimators[args.scale_rewards], {}, compose(**native)


def rollout_batch(output: dict, rewards: Tensor, group_size: int) -> RolloutBatch:
    """A ``RolloutBatch`` of TRL's generation output (prompts left-padded, completions right-padded;
    the tool mask applied) with this process's rewards: what ``group_gradients`` reads."""
    prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
    mask = output["completion_mask"] * output.get("tool_mask", 1)
    attention = torch.cat([prompt_mask, output["completion_mask"]], dim=1)
    rows = prompt_ids.shape[0]
    return RolloutBatch(input_ids=torch.cat([prompt_ids, output["completion_ids"]], dim=1), attention_mask=attention,
                        position_ids=position_ids_from_mask(attention),
                        response_mask=torch.cat([torch.zeros_like(prompt_mask), mask], dim=1).float(),
                        rollout_logp=None, rewards=rewards.float(),
                        group=torch.arange(rows, device=prompt_ids.device) // group_size, correct=rewards >= 1,
                        response_texts=[""] * rows, problems=[None] * rows, prompt_len=prompt_ids.shape[1],
                        stopped=torch.ones(rows, dtype=torch.bool), prompt_texts=[])


class DiagnoseCallback(TrainerCallback):
    """In-training diagnosis for TRL's ``GRPOTrainer`` (or ``CreditGRPOTrainer``): every ``every``-th
    generation batch, before it is trained on, its groups give the matched-signal efficiency of
    ``estimators`` (creditrl labels; default rloo, grpo, otb) against the estimator the trainer uses,
    under its loss, over a sliding ``window`` of diagnosed batches (``creditrl.runtime.step_diagnosis``,
    as ``logging.diagnose_every`` in ``creditrl train``). Metrics ``diagnose/<estimator>/efficiency``
    (+ ``_low``, ``_high``), ``diagnose/<estimator>/cosine`` (+ ``_low``, ``_high``), ``diagnose/noise_scale`` and
    ``time_diagnose`` go to TRL's log; ``summary()`` gives the window as Markdown. One process, or
    whole groups per process::

        trainer = GRPOTrainer(...)
        trainer.add_callback(DiagnoseCallback(trainer, every=10))
    """

    def __init__(self, trainer, *, every: int = 10, estimators: list[str] | None = None, window: int = 8,
                 max_memory_gb: float = 1.0):
        for name, value in (("every", every), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        self.trainer, self.every, self.generations = trainer, every, 0
        self.group_size = trainer.num_generations
        if self.group_size < 2:
            raise ValueError(f"num_generations: in-training diagnosis compares estimators within each group, which "
                             f"needs num_generations >= 2, got {self.group_size}")
        configured, options, loss = trl_setting(trainer)
        rows = compared_rows(configured, options, estimators, options.get("k"))
        groups = max(2, trainer.args.per_device_train_batch_size // self.group_size)
        self.diagnosis = StepDiagnosis(trainer.model, rows, configured, loss, temperature=trainer.temperature,
                                       window=window, groups=groups, max_memory_gb=max_memory_gb, seed=trainer.args.seed)
        self._rewards: list[Tensor] = []
        self._calculate, self._generate = trainer._calculate_rewards, trainer._generate_and_score_completions
        trainer._calculate_rewards = self._capture_rewards
        trainer._generate_and_score_completions = self._generate_and_diagnose

    def _capture_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = self._calculate(inputs, prompts, completions, completion_ids_list)
        self._rewards.append(rewards)
        return rewards

    def _generate_and_diagnose(self, inputs):
        self._rewards.clear()
        output = self._generate(inputs)
        trainer = self.trainer
        if not trainer.model.training or not self._rewards:
            return output
        self.generations += 1
        if self.generations % self.every:
            return output
        per_func = self._rewards[-1]
        rewards = (per_func * trainer.reward_weights.to(per_func.device)[None]).nansum(dim=1)
        local = output["prompt_ids"].shape[0]
        start = trainer.accelerator.process_index * local
        if local % self.group_size:
            raise ValueError(f"DiagnoseCallback: this process holds {local} completions, not whole groups of "
                             f"num_generations={self.group_size}")
        batch = rollout_batch(output, rewards[start:start + local], self.group_size)
        for key, value in self.diagnosis.observe(batch).items():
            trainer._metrics["train"][key].append(value)
        return output

    def summary(self) -> str:
        """The window's efficiencies and the cost per diagnosed batch, as Markdown."""
        return "\n".join(self.diagnosis.table())
