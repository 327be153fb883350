"""creditrl inside verl 0.9: every estimator as ``creditrl_<name>``, STAPO and GRPO-λ policy losses.

verl imports this module on ``import verl`` through the ``verl.plugins`` entry point declared in
creditrl's ``pyproject.toml`` (also loadable with ``VERL_USE_EXTERNAL_MODULES`` or
``actor_rollout_ref.model.external_lib``). Importing it is idempotent: a reload replaces its own
registrations and refuses names bound to somebody else's function.

- Advantage estimators, verl's convention (``core_algos.register_adv_est``)::

      fn(token_level_rewards [B,T], response_mask [B,T], index: np.ndarray of uids, config, *,
         old_log_probs=None, sum_pi_squared=None, rollout_is_weights=None, **kwargs)
        -> (advantages [B,T], returns [B,T])

  Energy w_t = 1 - 2 exp(old_log_probs) + sum_pi_squared (OTB eq. 7); IS weights from
  ``rollout_is_weights`` (OTB App. D). Estimator options come from ``algorithm.creditrl``
  (e.g. ``+algorithm.creditrl.k=4`` for maxpo). ``creditrl_gdpo`` reads its reward components from
  the fields named by verl's own ``algorithm.gdpo_reward_keys`` (weights ``gdpo_reward_weights``).
- Policy losses ``creditrl`` (any of creditrl's loss terms), ``creditrl_stapo`` and
  ``creditrl_grpo_lambda`` (the same with STAPO / GRPO-λ on) (``register_policy_loss``), verl's
  keyword set ``old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
  rollout_is_weights``, built on ``creditrl.PolicyLoss``; options from ``actor.policy_loss``
  (``CreditPolicyLossConfig``: fields generated from the loss-term registry, ``stapo``/``stapo_*``,
  ``trace``/``trace_*``, the switches ``cispo``, ``gspo``, ``sapo``, ``geo_mean``, ``dppo_tv``,
  ``dppo_kl``, ``clip_cov``, ``kl_cov`` (or a ``loss_terms`` entry by name), and ``loss_terms`` for a
  user's terms by import path) and from verl's own actor keys (``VERL_NATIVE``; SAPO's
  ``tau_pos``/``tau_neg`` and Clip-/KL-Cov's ``policy_loss.clip_cov_*``, ``kl_cov_ratio``,
  ``ppo_kl_coef``: ``verl_native_options``). verl's ``rollout_is_weights`` are the surrogate's data
  weights, as in verl's own losses.
- Trainer hooks (verl 0.9.1 limitations, see docs/verl.md): its ``compute_advantage`` forwards
  ``sum_pi_squared``/``old_log_probs``/``rollout_is_weights`` only to its own OTB, and its
  ``ppo_loss`` never passes the entropy to a policy loss. ``install_trainer_hooks`` wraps both —
  the one place verl functions are rebound — from verl's public extension points (no import
  machinery is patched).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import sys
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor
from verl.trainer.ppo import core_algos
from verl.workers.config import PolicyLossConfig

from creditrl.core.estimators import build_batch, estimator_result, list_estimators, with_energy
from creditrl.core.estimators.registry import AdvantageBatch, get_estimator
from creditrl.integrations import check_estimator_options, loss_term_fields
from creditrl.integrations.energy import check_actor_stat_range, checked_energy_from_logp
from creditrl.core.losses import Fields, PolicyLoss, compose
from creditrl.utils.imports import is_builtin
from creditrl.utils.validate import check_choice, check_tensor

PREFIX = "creditrl_"
ENERGY_KEYS = ("old_log_probs", "sum_pi_squared", "rollout_is_weights")
POLICY_LOSSES = {"creditrl": (), "creditrl_stapo": ("stapo",), "creditrl_grpo_lambda": ("trace",)}  # name -> terms on
_MARK = "__creditrl__"  # attribute naming the creditrl object a verl-side function stands for


# ----------------------------------------------------------------------------- estimators
def group_ids(index: Any, batch_size: int, device: torch.device) -> Tensor:
    """verl's ``index`` (numpy object array of uids, or None) -> dense int64 group ids [B], mapped
    once, vectorised (no Python loop over rows): from the blocks of equal neighbours when each uid
    forms one block (``_block_ids``), else by ``np.unique(..., return_inverse=True)``."""
    if index is None:
        raise ValueError("index: expected the prompt uids [B] (data.non_tensor_batch['uid']), got None")
    index = np.asarray(index)
    if index.shape != (batch_size,):
        raise ValueError(f"index: expected shape [{batch_size}], got {list(index.shape)}")
    if index.dtype == object:
        missing = np.flatnonzero(np.equal(index, None) | (index != index))     # None or NaN
    else:
        missing = np.flatnonzero(np.isnan(index)) if index.dtype.kind in "fc" else np.empty(0, dtype=np.int64)
    if missing.size:
        raise ValueError(f"index: expected one uid per row, got None/NaN at rows {missing[:8].tolist()} "
                         f"({missing.size} row(s)); each would otherwise be pooled into one group")
    try:
        inverse = _block_ids(index)
        if inverse is None:
            inverse = np.unique(index, return_inverse=True)[1]
    except TypeError:
        kinds = sorted({type(uid).__name__ for uid in index.tolist()})
        raise ValueError(f"index: expected uids of one type (verl's are str), got a mix of {kinds}") from None
    return torch.from_numpy(inverse.reshape(-1)).to(device)


def _block_ids(index: np.ndarray) -> np.ndarray | None:
    """Group ids [B] of uids that come in contiguous blocks of distinct uids (verl repeats each
    prompt's uid over its n responses): one vectorised comparison of neighbours and a sort of the
    block heads only (7x faster than ``np.unique`` over every row at B = 1,024); None otherwise."""
    starts = np.empty(index.shape[0], dtype=bool)
    starts[:1] = True
    np.not_equal(index[1:], index[:-1], out=starts[1:])
    heads = index[starts]
    if np.unique(heads).shape[0] != heads.shape[0]:   # a uid in two blocks: not contiguous
        return None
    return np.cumsum(starts) - 1


def check_actor_stats(response_mask: Tensor, old_log_probs: Tensor | None, sum_pi_squared: Tensor | None,
                      mask_rule: Callable[[Tensor], None] | None = None) -> Tensor | None:
    """The energy from the actor's per-token stats (``checked_energy_from_logp``: ``old_log_probs``
    <= 0 and ``sum_pi_squared`` in (0, 1] on the response tokens, tested in the energy's own pass;
    0 off them, so finite and >= 0 on every token), or None without both. One of them alone (an
    estimator that needs neither) is range-checked token by token. verl pads both with 0 off the
    response, where nothing is tested. ``mask_rule`` (with both): ``response_mask`` is a float32
    mask whose 0/1 rule runs in the same pass (``checked_energy_from_logp``)."""
    given = {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared}
    for name, x in given.items():
        if x is not None and (not isinstance(x, Tensor) or x.shape != response_mask.shape):
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a tensor of response_mask's shape {list(response_mask.shape)}, "
                             f"got {got}")
        if x is not None and not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if old_log_probs is not None and sum_pi_squared is not None:
        return checked_energy_from_logp(old_log_probs, sum_pi_squared, response_mask, mask_rule)
    if mask_rule is not None:
        raise ValueError("mask_rule: expected None without both old_log_probs and sum_pi_squared (no energy pass "
                         "to run the rule in)")
    for name, x in given.items():
        if x is not None:
            check_actor_stat_range(name, x, response_mask)
    return None


def estimator_options(config: Any) -> dict:
    """Options for creditrl's estimator: the ``creditrl`` node of verl's algorithm config."""
    node = None if config is None else config.get("creditrl", None)
    return {} if node is None else {str(k): v for k, v in dict(node).items()}


def verl_algorithm_options(name: str, config: Any, options: dict) -> dict:
    """``options`` with verl's own algorithm keys that mean the same in creditrl: ``algorithm.gamma``
    is the discount of a token-level estimator's returns-to-go (verl's reinforce_plus_plus reads it),
    and ``algorithm.norm_adv_by_std_in_grpo=False`` is grpo's ``scale='none'`` (as in verl's grpo;
    dr_grpo never divides). Either is refused where it would do nothing (a sequence-level estimator
    has no returns to discount; only grpo's std division can be turned off), or where
    ``algorithm.creditrl`` says otherwise. Unset or at verl's defaults (1.0, True), they change nothing."""
    if config is None:
        return options
    options, spec = dict(options), get_estimator(name)
    gamma = config.get("gamma", 1.0)
    if gamma is not None and float(gamma) != 1.0:
        if not spec.token_level:
            raise ValueError(f"algorithm.gamma: {PREFIX}{name} takes one outcome reward per response (no "
                             f"returns-to-go to discount), so gamma would do nothing; expected 1.0 (verl's "
                             f"default), got {gamma}")
        if "gamma" in options and float(options["gamma"]) != float(gamma):
            raise ValueError(f"algorithm.gamma={gamma} and algorithm.creditrl.gamma={options['gamma']} disagree; "
                             f"set one")
        options["gamma"] = float(gamma)
    if config.get("norm_adv_by_std_in_grpo", True) is False and name != "dr_grpo":     # dr_grpo: no std anyway
        if name != "grpo":
            raise ValueError(f"algorithm.norm_adv_by_std_in_grpo: False turns off GRPO's division by the group std, "
                             f"which is {PREFIX}grpo's scale='none'; {PREFIX}{name} has no such option, so it "
                             f"could not be honoured; expected True (verl's default), got False")
        if options.get("scale", "none") != "none":
            raise ValueError(f"algorithm.norm_adv_by_std_in_grpo=False and algorithm.creditrl.scale="
                             f"{options['scale']!r} disagree; set one")
        options["scale"] = "none"
    return options


def reward_components(config: Any, non_tensor_batch: Any, rows: int,
                      device: torch.device) -> tuple[Tensor | None, list | None]:
    """The reward components [B,K] and weights of ``algorithm.gdpo_reward_keys`` /
    ``gdpo_reward_weights`` (verl's own gdpo keys: fields of compute_score's returned dict, which verl
    keeps in ``non_tensor_batch``); (None, None) when no keys are set."""
    keys = None if config is None else config.get("gdpo_reward_keys", None)
    if not keys:
        return None, None
    if non_tensor_batch is None:
        raise ValueError("algorithm.gdpo_reward_keys: set, but verl passed no non_tensor_batch to the estimator; "
                         "keep creditrl's trainer hook installed (legacy trainer, trainer.use_v1=False)")
    missing = [k for k in keys if k not in non_tensor_batch]
    if missing:
        raise ValueError(f"algorithm.gdpo_reward_keys: {missing} not among the batch's reward fields "
                         f"{sorted(non_tensor_batch)}; compute_score must return a dict holding them")
    values = np.stack([np.asarray(non_tensor_batch[k], dtype=np.float64).reshape(rows) for k in keys], 1)
    weights = config.get("gdpo_reward_weights", None)
    return torch.from_numpy(values).to(device), None if weights is None else list(weights)


def advantages_and_returns(batch: AdvantageBatch, result: Tensor, energy: Tensor | None) -> tuple[Tensor, Tensor]:
    """A token-level estimator's checked ``result`` ([B] or [B,T]) -> its advantages and the returns-to-go
    [B,T] (as verl's OTB returns), each tensor written once; ``energy`` is this wrapper's own buffer
    (None without the actor's stats), dead by now. The batch is not read afterwards."""
    if result.dim() == 1 and batch.constant_returns and torch.equal(result, batch.rewards):
        advantages = batch.on_tokens(result, last_use=True)       # = the returns (reinforce's): one tensor
        return advantages, advantages
    if energy is not None and batch.constant_returns and "returns" not in batch.__dict__:
        returns = torch.mul(batch.rewards[:, None], batch.valid, out=energy)   # R on every valid token
    elif result.dim() == 1 and batch.constant_returns and batch.mask_is_callers_float32:
        # A and R (REINFORCE++'s) from one read of the caller's mask; another mask's float32 copy is
        # creditrl's own, and on_tokens writes A into it without a fresh tensor
        return batch.broadcast_pair(result, batch.rewards)
    else:
        returns = batch.returns
    return batch.on_tokens(result, last_use=True), returns


def missing_energy_fix(no_actor_stats: bool) -> str:
    """What to set when an energy estimator lacks the actor's tensors: verl hands an estimator
    ``old_log_probs`` (always in the batch) only through creditrl's hook, so without them the hook
    is missing; with them, ``sum_pi_squared`` is."""
    if no_actor_stats:
        return ("verl passed neither, so creditrl's trainer hook is not installed in the driver: set "
                "actor_rollout_ref.model.external_lib=creditrl.integrations.verl_hooks (legacy trainer, "
                "trainer.use_v1=False; see docs/verl.md)")
    return "the batch has no sum_pi_squared: set actor_rollout_ref.actor.calculate_sum_pi_squared=True"


def make_adv_estimator(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """verl-convention wrapper of creditrl's estimator ``name`` (see module docstring)."""
    needs_energy = get_estimator(name).needs_energy
    reads_components = get_estimator(name).reward_components

    def estimator(token_level_rewards: Tensor, response_mask: Tensor, index: np.ndarray | None = None,
                  config: Any = None, *, old_log_probs: Tensor | None = None,
                  sum_pi_squared: Tensor | None = None, rollout_is_weights: Tensor | None = None,
                  non_tensor_batch: Any = None, **kwargs) -> tuple[Tensor, Tensor]:
        check_tensor("token_level_rewards", token_level_rewards, ndim=2)
        check_tensor("response_mask", response_mask, shape=list(token_level_rewards.shape))
        if needs_energy and (old_log_probs is None or sum_pi_squared is None):
            raise ValueError(f"{PREFIX}{name}: needs old_log_probs and sum_pi_squared from the actor; "
                             + missing_energy_fix(old_log_probs is None))
        options = check_estimator_options(name, verl_algorithm_options(name, config, estimator_options(config)),
                                          "algorithm.creditrl")
        gamma = options.pop("gamma", 1.0)
        components, weights = reward_components(config, non_tensor_batch, response_mask.shape[0],
                                                response_mask.device) if reads_components else (None, None)
        with torch.no_grad():
            # the rewards as verl gives them: a score on a masked token counts in the row total
            # (sequence-level) or at the nearest preceding valid token (token-level returns).
            # The mask first: verl's int64 one becomes the checked float32 copy the actor's stats
            # are tested against (their one-pass test) and the estimator multiplies by
            batch = build_batch(rewards=token_level_rewards, mask=response_mask,
                                group=group_ids(index, response_mask.shape[0], response_mask.device), gamma=gamma,
                                components=components, component_weights=weights,
                                defer_mask_check=is_builtin(get_estimator(name).fn))   # on_tokens below checks
            energy = None                 # without the actor's stats, a float32 mask's check waits for the broadcast
            if old_log_probs is not None and sum_pi_squared is not None and batch.rule_pending:
                # a float32 mask (the valid tokens' weights as they are) is checked in the energy's pass
                energy = batch.mask_error_first(check_actor_stats, batch.input_mask, old_log_probs, sum_pi_squared,
                                                batch.accept_mask_stats)
            elif old_log_probs is not None or sum_pi_squared is not None:
                energy = check_actor_stats(batch.valid, old_log_probs, sum_pi_squared)
            if energy is not None:
                batch = with_energy(batch, energy, rollout_is_weights, checked=True)   # checked_energy_from_logp's
            result = estimator_result(name, batch, **options)
            if not get_estimator(name).masked_output:
                # sequence-level: the advantages as returns, as verl's own outcome estimators (verl reads
                # returns only for a critic); nothing reads the batch after this, so a [B] result goes
                # into its own copy of the mask
                advantages = batch.on_tokens(result, last_use=True)
                return advantages, advantages
            return advantages_and_returns(batch, result, energy)

    estimator.__name__ = estimator.__qualname__ = f"compute_{PREFIX}{name}_advantage"
    estimator.__doc__ = f"creditrl estimator {name!r} ({get_estimator(name).doc}) in verl's calling convention."
    setattr(estimator, _MARK, name)
    return estimator


def _register(registry: dict, name: str, fn: Callable, register: Callable) -> None:
    """Bind ``name`` to ``fn``, replacing an earlier creditrl binding (module reloads)."""
    old = registry.get(name)
    if old is not None and old is not fn:
        if getattr(old, _MARK, None) is None:
            raise ValueError(f"verl already binds {name!r} to {old!r}, which is not creditrl's; "
                             "refusing to replace it")
        del registry[name]
    register(name)(fn)


def register_estimators() -> list[str]:
    """Register every creditrl estimator as ``creditrl_<name>``; return the verl names."""
    names = []
    for name in list_estimators():
        _register(core_algos.ADV_ESTIMATOR_REGISTRY, PREFIX + name, make_adv_estimator(name),
                  core_algos.register_adv_est)
        names.append(PREFIX + name)
    return names


# ----------------------------------------------------------------------------- policy losses
def _first_set(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


# creditrl's flat loss options as verl holds them: (actor config, loss_agg_mode) -> value. KL and
# rollout correction stay verl's own (actor.use_kl_loss; algorithm.rollout_correction, whose
# rollout_is_weights multiply the advantages), so creditrl's are off here.
VERL_NATIVE = {
    "clip_low": lambda config, mode: _first_set(config.get("clip_ratio_low", None), config.get("clip_ratio", 0.2)),
    "clip_high": lambda config, mode: _first_set(config.get("clip_ratio_high", None), config.get("clip_ratio", 0.2)),
    "clip_c": lambda config, mode: config.get("clip_ratio_c", 3.0),
    "agg": lambda config, mode: "token-mean" if mode == "token-sum" else mode,   # token-sum: see global_scale
    "max_len": lambda config, mode: (int(config.get("loss_scale_factor", None))
                                     if mode == "seq-mean-token-sum-norm" and config.get("loss_scale_factor", None)
                                     else None),
    "kl_coef": lambda config, mode: 0.0,
    "kl_estimator": lambda config, mode: "k3",
    "kl_bias_correction": lambda config, mode: False,
    "rollout_correction": lambda config, mode: None,
    "rollout_cap": lambda config, mode: 2.0,
}


VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def verl_native_options(config: Any) -> dict[str, dict[str, Any]]:
    """The options of creditrl's terms that verl holds under its own names: SAPO's ``tau_pos`` /
    ``tau_neg`` (actor) and Clip-Cov's / KL-Cov's fields (``actor.policy_loss``); unset = the term's
    default, which is verl's."""
    node = config.get("policy_loss", None) if config is not None else None

    def fields(source: Any, names: tuple[str, ...]) -> dict[str, Any]:
        values = {} if source is None else {k: source.get(k, None) for k in names}
        return {k: v for k, v in values.items() if v is not None}
    return {"sapo": fields(config, ("tau_pos", "tau_neg")),
            "clip_cov": fields(node, ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
            "kl_cov": fields(node, ("kl_cov_ratio", "ppo_kl_coef"))}


VERL_NATIVE_OPTIONS = ("sapo", "clip_cov", "kl_cov")


def check_terms_for_verl(terms: dict[str, Any]) -> dict[str, Any]:
    """Refuse the terms verl's policy-loss call cannot feed: ``mask_truncated`` (no truncation
    flags reach a verl policy loss) and an adaptive ``entropy_bonus`` (no optimizer-step hook)."""
    if "mask_truncated" in terms:
        raise ValueError("mask_truncated: verl passes a policy loss no truncation flags; drop it (verl's DAPO "
                         "reward manager's overlong_buffer shapes over-long responses instead)")
    bonus = terms.get("entropy_bonus")
    if bonus is not None and bonus.adaptive:
        raise ValueError("entropy_bonus_adaptive: verl calls a policy loss per micro-batch with no optimizer-step "
                         "hook to adapt β; use a static entropy_bonus_coef (or verl's actor.entropy_coeff)")
    return terms


def check_loss_mode(config: Any) -> None:
    """``loss_mode`` and creditrl's fields agree: verl's own loss modes read none of creditrl's fields,
    a ``creditrl*`` mode must be one of ``POLICY_LOSSES``, and a mode that switches a term on (e.g.
    ``creditrl_stapo``) refuses that term set to False."""
    mode = config.loss_mode
    own = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    given = [f.name for f in dataclasses.fields(config) if f.name not in own and getattr(config, f.name) is not None]
    if mode not in POLICY_LOSSES:
        if str(mode).startswith(PREFIX):
            raise ValueError(f"loss_mode: expected one of {list(POLICY_LOSSES)} (creditrl's) or one of verl's, "
                             f"got {mode!r}")
        if given:
            raise ValueError(f"loss_mode: {mode!r} is verl's own policy loss, which reads none of creditrl's fields "
                             f"({', '.join(given)}); expected one of {list(POLICY_LOSSES)} with them, got {mode!r}")
        return
    for term in POLICY_LOSSES[mode]:
        if getattr(config, term, None) is False:
            raise ValueError(f"{term}: loss_mode={mode!r} switches {term} on; expected {term} unset or true, got "
                             f"False (loss_mode='creditrl' is the loss without it)")


def _install_hooks_after_init(self) -> None:
    parent = getattr(PolicyLossConfig, "__post_init__", None)
    if parent is not None:
        parent(self)
    check_loss_mode(self)
    defaults = {name: value({}, "token-mean") for name, value in VERL_NATIVE.items()}
    options = verl_native_options({"policy_loss": self})
    check_terms_for_verl(compose(Fields(lambda key: getattr(self, key, None), defaults,   # checks the options now
                                        native_options=options)).chosen)
    install_trainer_hooks()  # verl builds this config after its trainer / loss modules are loaded


# PolicyLossConfig plus creditrl's loss-term options, generated from the registry (loss_term_fields).
CreditPolicyLossConfig = dataclasses.make_dataclass(
    "CreditPolicyLossConfig", loss_term_fields(native=VERL_NATIVE, native_options=VERL_NATIVE_OPTIONS, typed=False),
    bases=(PolicyLossConfig,), namespace={"__post_init__": _install_hooks_after_init})
CreditPolicyLossConfig.__module__ = __name__  # importable by hydra's _target_ and picklable for Ray
CreditPolicyLossConfig.__doc__ = ("verl's PolicyLossConfig plus creditrl's loss-term options (stapo, stapo_*, "
                                  "trace, trace_*, cispo, gspo, sapo, clip_cov, ..., loss_terms); SAPO's, Clip-Cov's "
                                  "and KL-Cov's options are verl's own fields; select it with "
                                  "actor.policy_loss._target_.")


_ENTROPY: contextvars.ContextVar[Tensor | None] = contextvars.ContextVar("creditrl_entropy", default=None)


@contextlib.contextmanager
def token_entropy(entropy: Tensor | None):
    """Make the padded token entropies [B,T] visible to creditrl's policy losses inside the block
    (verl's policy-loss signature has no entropy; ``wrap_ppo_loss`` uses this around each call)."""
    token = _ENTROPY.set(entropy)
    try:
        yield
    finally:
        _ENTROPY.reset(token)


def global_scale(loss: Tensor, mask: Tensor, mode: str, info: dict) -> Tensor:
    """Rescale a micro-batch loss aggregated by creditrl to verl's global-batch normalisation.

    verl divides by the global token count (``batch_num_tokens``) or sequence count
    (``global_batch_size``) and multiplies by ``dp_size`` so gradients are invariant to the
    micro-batch split (``core_algos.agg_loss``); creditrl normalised by the local counts.
    ``mode="responses"`` (an aggregation term of creditrl's own, e.g. ``delta_l_norm``, whose
    global normaliser verl does not pass): each micro-batch's loss weighted by its share of the
    responses, so weights summing to one stay so (ΔL stays unbiased).
    """
    dp_size = info.get("dp_size", 1) or 1
    tokens = mask.sum()
    if mode == "responses":
        total = info.get("global_batch_size")
        return loss if total is None else loss * (mask.sum(-1) > 0).sum() / total * dp_size
    if mode == "token-sum":
        return loss * tokens * dp_size
    if mode == "token-mean":
        total = info.get("batch_num_tokens")
        return loss if total is None else loss * tokens / total * dp_size
    seqs = mask.shape[0] if mode == "seq-mean-token-sum-norm" else (mask.sum(-1) > 0).sum()
    total = info.get("global_batch_size")
    return loss if total is None else loss * seqs / total * dp_size


def make_policy_loss(loss_mode: str) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    """verl-signature policy loss ``loss_mode`` (a key of ``POLICY_LOSSES``): creditrl's terms from
    ``actor.policy_loss`` and ``VERL_NATIVE``, then verl's global-batch scale."""
    switched_on = POLICY_LOSSES[loss_mode]

    def compute_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError("config: expected verl's ActorConfig, got None")
        check_choice("loss_agg_mode", loss_agg_mode, VERL_AGG_MODES)
        node = config.get("policy_loss", None)
        native = {name: value(config, loss_agg_mode) for name, value in VERL_NATIVE.items()}
        loss_fn = PolicyLoss(check_terms_for_verl(compose(Fields(
            lambda key: None if node is None else node.get(key, None), native, switched_on=switched_on,
            native_options=verl_native_options(config))).chosen))
        entropy = _ENTROPY.get()
        if loss_fn.needs_entropy and entropy is None:
            raise ValueError(f"{loss_mode}: needs the token entropies; set actor_rollout_ref.actor.calculate_entropy="
                             "True, and actor.policy_loss._target_=creditrl.integrations.verl.CreditPolicyLossConfig: "
                             "building it in each worker installs the hook that passes them to the loss "
                             + ("(installed here)" if hook_installed("verl.workers.utils.losses") else
                                "(not installed in this process)") + "; see docs/verl.md")
        mask = response_mask.bool()
        # verl's rollout_is_weights multiply the surrogate (pg_losses * rollout_is_weights): creditrl's data weights
        if entropy is not None and not loss_fn.entropy_grad:
            entropy = entropy.detach()
        loss, metrics = loss_fn(log_prob, old_log_prob, advantages, mask, entropy=entropy,
                                weights=None if rollout_is_weights is None else rollout_is_weights.detach())
        own_aggregation = any(term.stage == "aggregate" and not term.flat for term, _ in loss_fn.terms)
        loss = global_scale(loss, mask, "responses" if own_aggregation else loss_agg_mode,
                            dict(config.get("global_batch_info", None) or {}))
        return loss, {**{f"actor/creditrl/{k}": v for k, v in metrics.items()},
                      **verl_metric_names(metrics, old_log_prob, log_prob, mask)}

    compute_policy_loss.__name__ = compute_policy_loss.__qualname__ = f"compute_policy_loss_{loss_mode}"
    compute_policy_loss.__doc__ = (f"creditrl's policy loss{' with ' + ', '.join(switched_on) if switched_on else ''} "
                                   "(creditrl.PolicyLoss) in verl's policy-loss signature.")
    setattr(compute_policy_loss, _MARK, loss_mode)
    return compute_policy_loss


@torch.no_grad()
def verl_metric_names(metrics: dict[str, float], old_log_prob: Tensor, log_prob: Tensor, mask: Tensor) -> dict:
    """verl's own loss metrics, so dashboards built on verl's losses keep working: ``actor/pg_clipfrac``
    (the surrogate's clip fractions, low + high), ``actor/pg_clipfrac_lower`` (the dual clip's) and
    ``actor/ppo_kl`` (the mean of log π_old − log π_θ over the response tokens, verl's k1). creditrl's
    fractions count kept tokens, verl's the response tokens: the same unless a term drops tokens. A
    fraction the loss did not measure (a surrogate that does not clip, the dual clip off) is left out."""
    tokens = mask.sum().clamp(min=1)
    ppo_kl = torch.where(mask, old_log_prob.detach() - log_prob.detach(), 0.0).sum() / tokens
    out = {"actor/ppo_kl": ppo_kl.item()}
    if "clip_frac_low" in metrics:
        out["actor/pg_clipfrac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    if "clip_frac_dual" in metrics:
        out["actor/pg_clipfrac_lower"] = metrics["clip_frac_dual"]
    return out


POLICY_LOSS_FNS = {name: make_policy_loss(name) for name in POLICY_LOSSES}
compute_policy_loss_stapo = POLICY_LOSS_FNS["creditrl_stapo"]
compute_policy_loss_grpo_lambda = POLICY_LOSS_FNS["creditrl_grpo_lambda"]


def register_policy_losses() -> list[str]:
    for name, fn in POLICY_LOSS_FNS.items():
        _register(core_algos.POLICY_LOSS_REGISTRY, name, fn, core_algos.register_policy_loss)
    return list(POLICY_LOSSES)


# ----------------------------------------------------------------------------- trainer hooks
def wrap_compute_advantage(original: Callable) -> Callable:
    """``ray_trainer.compute_advantage`` that also hands creditrl estimators the actor's
    ``sum_pi_squared``, ``old_log_probs`` and ``rollout_is_weights`` (verl passes them to its OTB only)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_advantage(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        data, name = bound.arguments["data"], bound.arguments["adv_estimator"]
        name = getattr(name, "value", name)
        if not (isinstance(name, str) and name.startswith(PREFIX)):
            return original(*args, **kwargs)
        batch = data.batch
        if "response_mask" not in batch.keys():  # as verl does for trainers that do not set it
            batch["response_mask"] = sys.modules[original.__module__].compute_response_mask(data)
        extra = {k: batch[k] for k in ENERGY_KEYS if k in batch.keys()}
        if get_estimator(name.removeprefix(PREFIX)).reward_components:    # gdpo: the reward fields
            extra["non_tensor_batch"] = data.non_tensor_batch
        fn = core_algos.get_adv_estimator_fn(name)
        batch["advantages"], batch["returns"] = fn(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
            index=data.non_tensor_batch.get("uid"), config=bound.arguments["config"], **extra)
        return data

    setattr(compute_advantage, _MARK, original)
    return compute_advantage


def wrap_ppo_loss(original: Callable) -> Callable:
    """``verl.workers.utils.losses.ppo_loss`` that exposes the padded token entropies to
    creditrl's policy losses for the duration of the call (verl does not pass them)."""

    @functools.wraps(original)
    def ppo_loss(config, model_output, data, dp_group=None):
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            from verl.workers.utils.padding import no_padding_2_padding
            entropy = no_padding_2_padding(entropy, data)
        with token_entropy(entropy):
            return original(config, model_output, data, dp_group)

    setattr(ppo_loss, _MARK, original)
    return ppo_loss


HOOKS = {  # module -> (attribute, wrapper factory); see install_trainer_hooks
    "verl.trainer.ppo.ray_trainer": ("compute_advantage", wrap_compute_advantage),
    "verl.workers.utils.losses": ("ppo_loss", wrap_ppo_loss),
}


def _patch(module_name: str) -> None:
    """Wrap the hooked function of ``module_name`` and rebind every imported alias of it."""
    attr, factory = HOOKS[module_name]
    current = getattr(sys.modules[module_name], attr)
    original = getattr(current, _MARK, current)  # unwrap an earlier creditrl wrapper (reload)
    wrapped = factory(original)
    for name, module in list(sys.modules.items()):
        bound = vars(module).get(attr) if name.startswith("verl.") and module is not None else None
        if bound is original or bound is current:  # vars(): never trigger a lazy module's __getattr__
            setattr(module, attr, wrapped)


def hook_installed(module_name: str) -> bool:
    """Whether ``HOOKS``' function of ``module_name`` is creditrl's wrapper in this process."""
    module = sys.modules.get(module_name)
    return module is not None and hasattr(getattr(module, HOOKS[module_name][0], None), _MARK)


def install_trainer_hooks() -> list[str]:
    """The one place creditrl rebinds verl functions (tested on verl 0.9.1): ``HOOKS`` lists them.

    verl 0.9.1 has no public hook for either: ``compute_advantage`` forwards the actor's energy
    tensors only to its own OTB, and ``ppo_loss`` never passes the entropy to a policy loss. For
    each hooked module already imported, the function is wrapped and every imported alias of it
    in verl's modules is rebound. Idempotent. Returns the modules hooked.

    It runs (no import machinery is patched) at three public extension points of verl:
    - on plug-in import (``import verl``'s ``verl.plugins`` entry point), for modules already loaded;
    - when verl builds ``CreditPolicyLossConfig`` (``actor.policy_loss._target_``), in the driver
      and in each worker, after their trainer and loss modules are loaded;
    - on import of ``creditrl.integrations.verl_hooks`` (``actor_rollout_ref.model.external_lib``),
      for runs that use creditrl's estimators with verl's own losses.
    """
    hooked = []
    for module_name in HOOKS:
        if module_name in sys.modules:
            _patch(module_name)
            hooked.append(module_name)
    return hooked


register_estimators()
register_policy_losses()
install_trainer_hooks()
