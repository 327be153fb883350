"""Policies: the embedded ``builtin:tiny`` or any local Hugging Face causal-LM directory.

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
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from creditrl.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
from creditrl.models.warm_start import WarmStartConfig, WarmStartResult, sample_responses, warm_start

BUILTINS = ("builtin:tiny",)
CACHE_VERSION = 2  # bump when the warm-start recipe changes so old entries are not reused
META_FILE = "warm_start.json"


@contextmanager
def _hf_progress(enabled: bool):
    """Silence transformers' save/load progress bars unless ``progress`` was asked for."""
    from transformers.utils import logging as hf_logging

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
        print(f"builtin:tiny warm start on {task.name}: {result.steps} steps, sampled accuracy "
              f"{result.accuracy:.2f}, {result.seconds:.1f}s -> {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-{path.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps({**asdict(result), "task": repr(task)}, indent=1))
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished the same entry first: keep theirs
            if not (path / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_policy(spec: str, task, *, model_cfg: TinyModelConfig | None = None,
                warm_start: WarmStartConfig | None = None, cache_dir: str | None = None,
                device: str = "cpu", seed: int = 0, progress: bool = True):
    """``(model, tokenizer)`` for ``spec``: ``"builtin:tiny"`` or a local HF model directory.
    The tokenizer pads on the left; a missing pad token falls back to EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model: expected 'builtin:tiny' or a local model directory, got {spec!r}")
    if spec.startswith("builtin:"):
        if spec not in BUILTINS:
            raise ValueError(f"model: unknown built-in {spec!r}; valid built-ins are {list(BUILTINS)}")
        model_cfg, warm_start = model_cfg or TinyModelConfig(), warm_start or WarmStartConfig()
        path = tiny_cache_path(task, model_cfg, warm_start, seed, cache_dir)
        if not (path / META_FILE).is_file():
            with _hf_progress(progress):
                build_tiny(task, model_cfg, warm_start, seed, path, progress)
    else:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model: {spec!r} is not a local directory; expected a Hugging Face "
                                    f"causal-LM directory (config.json + weights + tokenizer) or one of {list(BUILTINS)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with _hf_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(path).to(device)
    model.eval()
    return model, tokenizer


def warm_start_info(path: str | os.PathLike) -> dict | None:
    """The warm-start record saved with a cached ``builtin:tiny`` (None for other models)."""
    meta = Path(path) / META_FILE
    return json.loads(meta.read_text()) if meta.is_file() else None


__all__ = ["BUILTINS", "TinyModelConfig", "WarmStartConfig", "WarmStartResult", "build_tiny", "cache_root",
           "char_tokenizer", "load_policy", "sample_responses", "tiny_cache_path", "tiny_model", "warm_start",
           "warm_start_info"]
