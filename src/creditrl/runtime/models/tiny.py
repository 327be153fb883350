"""The embedded ``builtin:tiny`` policy: a character tokenizer built with ``tokenizers`` and a
~1M-parameter Llama built from a ``LlamaConfig`` (nothing is downloaded).

One character is one token, so a task's ``alphabet()`` fixes the vocabulary; pad/bos/eos/unk
are special tokens whose text (``<|pad|>`` …) cannot collide with task text. Padding is on
the left, as generation needs. The encoder adds no special tokens, so
``decode(encode(s)) == s`` for every string over the alphabet.
"""
from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from creditrl.config import TinyModelConfig

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def char_tokenizer(alphabet: str, model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer over ``alphabet`` (duplicates ignored) + special tokens.

    Ids: 0 pad, 1 bos, 2 eos, 3 unk, then the characters in sorted order; characters
    outside the alphabet encode to unk.
    """
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"alphabet: expected a non-empty str, got {alphabet!r}")
    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, padding_side="left", model_max_length=model_max_length)


def tiny_model(tokenizer, cfg: TinyModelConfig = TinyModelConfig(), seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised Llama sized by ``cfg`` for ``tokenizer`` (seeded, reproducible)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
