"""What a local model directory must hold, checked before anything loads, with an error naming
the file that is missing or damaged.

- A directory with a creditrl ``manifest.json`` (a run's ``final/``, written atomically) is
  checked against it: every file present, of the recorded size and SHA-256.
- Any other directory (your own Hugging Face directory, a ``final/`` written before manifests) is
  checked for its parts: ``config.json`` (valid JSON with a ``model_type``), the weights
  (``model.safetensors``, its sharded index and every shard it names, or ``pytorch_model.bin``),
  whose safetensors headers must be readable and fit the file (a copy cut short fails here), and
  tokenizer files. A LoRA adapter directory (``adapter_config.json``) needs its adapter weights
  and a base model directory, checked the same way.
- After loading, ``check_finite_weights`` refuses weights holding NaN/inf, naming the tensor.
- ``load_failure`` turns what transformers or peft raise while loading (e.g. a config.json that
  does not match the weights) into an error naming the directory.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from creditrl.utils.io import MANIFEST, manifest_problem, read_manifest

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


class ModelDirError(ValueError):
    """A model directory that cannot be loaded; the message names the file and what is wrong."""


def check_finite_weights(model, where: str) -> None:
    """ModelDirError naming the first parameter holding NaN/inf and the directory ``where`` it came
    from: such weights give NaN log-probs and every sample garbage (accuracy 0), which would look
    like a real result. One pass, one ``isfinite`` per tensor."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            bad = int((~torch.isfinite(param)).sum())
            raise ModelDirError(f"model.name: the weights loaded from {where!r} are not finite: {name} "
                                f"{tuple(param.shape)} holds {bad} NaN/inf value(s); the model is damaged")


def _json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelDirError(f"{what}: {path.name} in {str(path.parent)!r} is not valid JSON ({err}); the directory "
                            f"is damaged") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{what}: {path.name} in {str(path.parent)!r} is not a JSON object")
    return data


def _safetensors_readable(path: Path, what: str) -> None:
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as err:  # noqa: BLE001 - safetensors' own error type, reported with the file
        raise ModelDirError(f"{what}: {path.name} in {str(path.parent)!r} is damaged or cut short ({err}); the "
                            f"directory is incomplete") from None


def _check_weights(path: Path, names: tuple[str, ...], what: str) -> None:
    found = [n for n in names if (path / n).is_file()]
    if not found:
        raise ModelDirError(f"{what}: {str(path)!r} has no weights file (expected one of {list(names)}); the "
                            f"directory is incomplete")
    name = found[0]
    if name.endswith(".index.json"):
        shards = sorted(set(_json(path / name, what).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if not shards or missing:
            raise ModelDirError(f"{what}: {str(path)!r}: the shard(s) {missing or '(none listed)'} named by {name} "
                                f"are missing")
        for shard in shards:
            if shard.endswith(".safetensors"):
                _safetensors_readable(path / shard, what)
    elif name.endswith(".safetensors"):
        _safetensors_readable(path / name, what)


def has_tokenizer(path: Path) -> bool:
    return any((path / n).is_file() for n in TOKENIZER_FILES)


def check_model_dir(path: Path, what: str = "model.name", *, tokenizer: bool = True) -> None:
    """Raise ModelDirError naming the missing or damaged file of model directory ``path``
    (``tokenizer``: whether it must hold tokenizer files itself)."""
    path = Path(path)
    if read_manifest_safely(path, what) is not None:
        problem = manifest_problem(path)
        if problem:
            raise ModelDirError(f"{what}: {str(path)!r} is damaged: {problem} (its {MANIFEST} records every file "
                                f"as written; the directory was cut short or changed since)")
        return
    if (path / "config.yaml").is_file() and (path / "metrics.jsonl").is_file():
        raise ModelDirError(f"{what}: {str(path)!r} is a creditrl run directory, not a model directory; its model "
                            f"is {str(path / 'final')!r}")
    if (path / "adapter_config.json").is_file():
        base = _json(path / "adapter_config.json", what).get("base_model_name_or_path")
        _check_weights(path, ADAPTER_WEIGHTS, what)
        if not isinstance(base, str) or not Path(base).expanduser().is_dir():
            raise ModelDirError(f"{what}: the LoRA adapter in {str(path)!r} names base model {base!r} in "
                                f"adapter_config.json, which is not a local directory")
        check_model_dir(Path(base).expanduser(), f"{what} (the base model of the adapter)", tokenizer=False)
        if not has_tokenizer(path) and not has_tokenizer(Path(base).expanduser()):
            raise ModelDirError(f"{what}: neither {str(path)!r} nor its base model has tokenizer files (expected "
                                f"one of {list(TOKENIZER_FILES)})")
        return
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{what}: {str(path)!r} has no config.json; expected a Hugging Face causal-LM directory "
                            f"(config.json + weights + tokenizer files) or a LoRA adapter directory")
    if "model_type" not in _json(path / "config.json", what):
        raise ModelDirError(f"{what}: config.json in {str(path)!r} has no model_type; it is not a transformers "
                            f"model config")
    _check_weights(path, WEIGHT_FILES, what)
    if tokenizer and not has_tokenizer(path):
        raise ModelDirError(f"{what}: {str(path)!r} has no tokenizer files (expected one of {list(TOKENIZER_FILES)}); "
                            f"save the tokenizer with the model (tokenizer.save_pretrained(dir))")


def read_manifest_safely(path: Path, what: str) -> dict | None:
    try:
        return read_manifest(path)
    except ValueError as err:
        raise ModelDirError(f"{what}: {str(path)!r} is damaged: {err}") from None


def load_failure(path: Path, part: str, err: Exception) -> ModelDirError:
    """The error to raise when transformers/peft fail to load ``part`` (tokenizer, model, adapter)
    of a directory that passed ``check_model_dir``."""
    text = str(err).strip().splitlines()
    first = next((line for line in text if line.strip()), type(err).__name__)[:300]
    if "size mismatch" in str(err) or "ignore_mismatched_sizes" in str(err):
        return ModelDirError(f"model.name: the weights in {str(path)!r} do not match its config.json (some tensor "
                             f"shapes differ from what config.json describes); the directory is inconsistent "
                             f"({type(err).__name__}: {first})")
    return ModelDirError(f"model.name: cannot load the {part} of {str(path)!r} ({type(err).__name__}: {first})")


def adapter_settings(path: Path) -> dict | None:
    """The LoRA settings (``r``, ``alpha``, ``dropout``, ``target_modules`` sorted) of the adapter
    directory ``path``, in ``model.lora``'s names, and its ``base`` model; None when ``path`` is
    not one."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    data = _json(config, "model.name")
    modules = data.get("target_modules")
    return {"r": data.get("r"), "alpha": data.get("lora_alpha"), "dropout": data.get("lora_dropout"),
            "target_modules": sorted(modules) if isinstance(modules, list) else modules,
            "base": data.get("base_model_name_or_path")}
