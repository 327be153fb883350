"""Nothing silent (part of the reliability issue): run directories you cannot corrupt by accident,
non-finite config numbers, group_size=1, rewards that cannot be gamed by formatting, non-finite
rewards and updates. Each test would fail on the behaviour before these changes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from creditrl.config import ConfigError, load_config, load_saved_config, save_config
from creditrl.runtime.setup import resolve_config
from creditrl.tasks import Problem, get_task
from creditrl.trainer import checkpoint as ckpt
from creditrl.trainer.logging import truncate_jsonl
from creditrl.trainer.rundir import RunDirError, RunLock, prepare_new_run

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.warm_start.max_steps=50", "model.warm_start.eval_every=25", "model.warm_start.eval_size=8",
        "task.options.digits=1", "train.eval_problems=4", "train.eval_samples=2", "logging.progress=false",
        "train.threads=1", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "algorithm.estimator=grpo", "train.save_every=1"]


# ----------------------------------------------------------------------------- run directories

def test_existing_run_directory_is_refused_unless_overwritten(tmp_path, capsys):
    from creditrl.cli import main
    args = ["train", "--no-progress", *TINY, f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}",
            "train.run_name=r"]
    assert main(args) == 0
    assert main(args) == 2                                  # a second start would append to the old logs
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume" in err and "--overwrite" in err
    assert main(args + ["--overwrite"]) == 0                # cleared, then trained again
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]
    assert not (tmp_path / "r" / ".lock").exists()          # released


def test_run_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / ".lock").write_text(str(live.pid))
        with pytest.raises(RunDirError, match=rf"in use by another creditrl process \(PID {live.pid}\)"):
            with RunLock(tmp_path):
                pass
    finally:
        live.kill()
        live.wait()
    (tmp_path / ".lock").write_text(str(live.pid))          # its process is gone now: stale
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
    assert not (tmp_path / ".lock").exists()
    (tmp_path / ".lock").write_text("garbage")              # unreadable owner: stale as well
    with RunLock(tmp_path):
        pass


def test_overwrite_never_clears_a_directory_a_live_run_holds(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / ".lock").write_text(str(live.pid))
        with pytest.raises(RunDirError, match="in use"):
            prepare_new_run(tmp_path, overwrite=True)
        assert (tmp_path / "metrics.jsonl").exists()
    finally:
        live.kill()
        live.wait()


def test_unwritable_output_dir_fails_before_the_model_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    import creditrl.trainer.loop as loop
    monkeypatch.setattr(loop, "load_configured_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(RunDirError, match="train.output_dir: cannot write in"):
        loop.train(load_config(None, [f"train.output_dir={blocker}"]), progress=False)


def _save(run, step, value=1.0):
    return ckpt.save_checkpoint(run, step, {"w": torch.full((3,), value)}, {"x": step}, keep_last=5)


@pytest.mark.parametrize("damage", ["truncate-weights", "truncate-state", "flip-byte", "no-manifest", "empty-state"])
def test_damaged_newest_checkpoint_falls_back_to_an_older_valid_one(tmp_path, damage):
    _save(tmp_path, 1, 1.0)
    newest = _save(tmp_path, 2, 2.0)
    target = {"truncate-weights": ckpt.WEIGHTS, "truncate-state": ckpt.STATE, "flip-byte": ckpt.WEIGHTS,
              "no-manifest": ckpt.MANIFEST, "empty-state": ckpt.STATE}[damage]
    path = newest / target
    data = path.read_bytes()
    if damage == "no-manifest":
        path.unlink()
    elif damage == "flip-byte":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "empty-state":
        path.write_bytes(b"")
    else:
        path.write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="skipped damaged checkpoint.*step_000002.*resuming from step_000001"):
        weights, state = ckpt.load_latest(tmp_path)
    assert state["step"] == 1 and weights["w"].tolist() == [1.0, 1.0, 1.0]


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
    path = _save(tmp_path, 1) / ckpt.WEIGHTS
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"no valid checkpoint .*step_000001: weights.safetensors has 0 bytes"):
        ckpt.load_latest(tmp_path)


def test_failed_checkpoint_write_leaves_nothing_and_names_the_path(tmp_path, monkeypatch):
    import creditrl.trainer.checkpoint as checkpoint

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(OSError, match=r"checkpoint: could not write .*step_000003.*No space left"):
        _save(tmp_path, 3)
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("text", ["", "model:\n  name: builtin:tiny\n", "{{{ not yaml", "- a list\n"])
def test_resume_refuses_an_incomplete_config(tmp_path, text):
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match="not filled in with defaults"):
        load_saved_config(tmp_path / "config.yaml")
    from creditrl.trainer import resume
    with pytest.raises(ConfigError):
        resume(tmp_path, progress=False)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=7"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_saved_config(tmp_path / "config.yaml").train.steps == 7


def test_log_rewrite_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 6))
    path.write_text(original)

    def dies(*a, **k):
        raise OSError(5, "I/O error")
    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(OSError, match="could not write .*metrics.jsonl"):
        truncate_jsonl(path, 2)
    assert path.read_text() == original                     # nothing lost
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]   # no temporary left behind


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("override, key", [
    ("optim.lr=.inf", "optim.lr"), ("rollout.temperature=nan", "rollout.temperature"),
    ("optim.max_grad_norm=nan", "optim.max_grad_norm"), ("loss.clip_low=-.inf", "loss.clip_low"),
    ("loss.kl_coef=.nan", "loss.kl_coef"), ("rollout.top_p=inf", "rollout.top_p")])
def test_non_finite_numbers_are_rejected(override, key):
    with pytest.raises(ConfigError, match=rf"{key}: expected a finite number"):
        resolve_config(load_config(None, [override]))


@pytest.mark.parametrize("value", ["1e-9", "0", "0.01", "11", "-1"])
def test_temperature_has_a_documented_range(value):
    with pytest.raises(ConfigError, match=r"rollout.temperature: expected a value (in \[0.05, 10.0\]|> 0)"):
        load_config(None, [f"rollout.temperature={value}"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "otb", "opo"])
def test_group_size_one_is_an_error_that_says_why(estimator):
    with pytest.raises(ConfigError, match=r"rollout.group_size: 1 response per prompt .* nothing would be learned"):
        resolve_config(load_config(None, ["rollout.group_size=1", f"algorithm.estimator={estimator}"]))
    resolve_config(load_config(None, ["rollout.group_size=1", "algorithm.estimator=reinforce"]))  # learns from one


# ----------------------------------------------------------------------------- rewards

@pytest.fixture
def numeric(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    return get_task("jsonl", path=str(path), checker="numeric")


@pytest.mark.parametrize("response, answer, reward", [
    ("1234568", "1234567", 0.0), ("1,2,3", "123", 0.0), ("1,234", "1234", 1.0), ("12,34", "1234", 0.0),
    ("the total is 1,234,567.", "1234567", 1.0), ("0.30000001", "0.3", 0.0), ("0.30", "0.3", 1.0),
    ("-5", "5", 0.0), ("1e3", "1000", 1.0), ("", "1", 0.0)])
def test_numeric_checker_is_exact(numeric, response, answer, reward):
    assert numeric.reward(Problem("q", answer), response) == reward


def test_math_checker_reads_the_tail_quietly(tmp_path, capfd):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "42"}\n{"prompt": "b", "answer": "2"}\n')
    task = get_task("jsonl", path=str(path), checker="math")
    huge = ("\\frac{" * 20 + "x" + "}" * 20 + " and ") * 4000 + "so the answer is $\\boxed{42}$"   # ~200 KB
    assert task.reward(Problem("a", "42"), "42") == 1.0   # starts the checker process (not what is timed)
    start = time.perf_counter()
    assert task.reward(Problem("a", "42"), huge) == 1.0
    assert time.perf_counter() - start < 5
    captured = capfd.readouterr()
    assert "frac" not in captured.err and "frac" not in captured.out


def test_non_finite_rewards_count_as_zero_and_are_logged():
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.trainer.update import Learner
    task = get_task("addition", digits=1)
    values = iter([float("nan"), float("inf"), 1.0, 0.0] * 4)
    task.reward = lambda problem, response: next(values)
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    batch = generate_rollouts(model, tok, task, [Problem("1+2=", "3"), Problem("2+2=", "4")], group_size=4,
                              max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    assert batch.rewards.tolist() == [0.0, 0.0, 1.0, 0.0] * 2 and batch.reward_invalid.sum() == 4
    cfg = load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=3",
                             "algorithm.estimator=grpo"])
    metrics = Learner(model, cfg).update(batch, torch.Generator().manual_seed(0)).metrics
    assert metrics["reward_invalid_frac"] == 0.5 and metrics["skipped_updates"] == 0


# ----------------------------------------------------------------------------- non-finite updates

def test_non_finite_gradient_never_reaches_the_weights():
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.trainer.update import Learner
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    batch = generate_rollouts(model, tok, task, [Problem("1+2=", "3")], group_size=4, max_new_tokens=3,
                              generator=torch.Generator().manual_seed(0))
    batch.rewards = torch.tensor([3e38, 0.0, -3e38, 0.0])   # finite, but the gradient overflows
    cfg = load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=1", "rollout.max_new_tokens=3",
                             "algorithm.estimator=dr_grpo", "optim.lr=1e-2"])
    before = [p.detach().clone() for p in model.parameters()]
    metrics = Learner(model, cfg).update(batch, torch.Generator().manual_seed(0)).metrics
    assert metrics["skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_repeated_skipped_updates_stop_the_run_naming_the_cause():
    from creditrl.trainer.loop import Trainer, TrainingStopped
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.step, trainer.skipped_streak = load_config(None, []), 5, 0
    trainer.check_skipped({"skipped_updates": 1, "reward_mean": 1e30})
    trainer.check_skipped({"skipped_updates": 0})          # a good step resets the count
    for _ in range(2):
        trainer.check_skipped({"skipped_updates": 1, "reward_mean": 1e30})
    with pytest.raises(TrainingStopped, match=r"NaN/inf for 3 steps in a row.*optim.lr=5e-05.*1e\+30"):
        trainer.check_skipped({"skipped_updates": 1, "reward_mean": 1e30})


def test_cli_reports_a_stopped_run_without_a_traceback(tmp_path, monkeypatch, capsys):
    import creditrl.trainer.loop as loop
    from creditrl.cli import main

    def stop(*a, **k):
        raise loop.TrainingStopped("training stopped at step 3: the loss or gradient was NaN/inf")
    monkeypatch.setattr("creditrl.cli.train", stop)
    assert main(["train", "--no-progress", f"train.output_dir={tmp_path}"]) == 2
    assert "training stopped at step 3" in capsys.readouterr().err
    assert Path(tmp_path).exists()


# ----------------------------------------------------------------------------- data

def _jsonl(tmp_path, body: bytes, name="d.jsonl"):
    path = tmp_path / name
    path.write_bytes(body)
    return str(path)


GOOD = b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'


@pytest.mark.parametrize("body, message", [
    (b"", r"d.jsonl has no rows"),
    (b"\n\n  \n", r"d.jsonl has no rows"),
    (GOOD + b'{"prompt": "3+3=", "answer": 6\n', r"d.jsonl line 3: malformed JSON"),
    (GOOD[:34] + b'{"prompt": "\xff", "answer": "1"}\n', r"d.jsonl line 2 is not valid UTF-8"),
    (b'{"prompt": "' + b"x" * (1 << 20) + b'", "answer": "1"}\n' + GOOD, r"d.jsonl line 1 is longer than 1 MiB"),
    (GOOD + b'[1, 2]\n"text"\n', r"line\(s\) 3, 4 are not JSON objects"),
    (GOOD + b'{"prompt": "5+5=", "answer": null}\n', r"row 3: answer: expected a string or a number"),
    (GOOD + b'{"prompt": "5+5=", "answer": {"a": 1}}\n', r"row 3: answer: expected a string or a number"),
    (GOOD + b'{"answer": "1"}\n{"prompt": null, "answer": "1"}\n', r"2 invalid row\(s\); row 3: prompt: .*; row 4"),
])
def test_bad_data_gets_one_clear_error(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        get_task("jsonl", path=_jsonl(tmp_path, body))


def test_a_json_array_file_reads_like_json_lines(tmp_path):
    task = get_task("jsonl", path=_jsonl(tmp_path, b'[{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]',
                                         name="d.json"))
    assert sorted(p.answer for p in task.train_set() + task.test_set()) == ["1", "2"]


def test_prompts_longer_than_the_context_are_refused_or_truncated(tmp_path):
    from creditrl.runtime.models.tiny import char_tokenizer
    from creditrl.tasks.chat import check_prompt_lengths, render_task_prompts
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 40 + "+1=", "answer": "1"}] + \
        [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(8)]
    path = _jsonl(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    tok = char_tokenizer("0123456789+=")
    task = get_task("jsonl", path=path)
    with pytest.raises(ValueError, match=r"1 prompt\(s\) are longer than the 15 tokens .*context \(20\).*"
                                         r"truncate_prompts=true"):
        check_prompt_lengths(tok, task, context=20, max_new_tokens=5)
    assert check_prompt_lengths(tok, task, context=64, max_new_tokens=5) == 0
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        check_prompt_lengths(tok, task, context=20, max_new_tokens=20)
    cut = get_task("jsonl", path=path, truncate_prompts=True)
    assert check_prompt_lengths(tok, cut, context=20, max_new_tokens=5) == 1
    (ids,) = render_task_prompts(tok, cut, ["9" * 40 + "+1="])
    assert len(ids) == 15 and tok.decode(ids).endswith("+1=")


# ----------------------------------------------------------------------------- library inputs

def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g)).requires_grad_()
    return logp, logp.detach() - 0.01, torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 5)


@pytest.mark.parametrize("max_len", [-3, 0])
def test_policy_loss_rejects_a_bad_max_len(max_len):
    from creditrl import policy_loss
    logp, old, adv, mask = _loss_inputs()
    with pytest.raises(ValueError, match=rf"max_len: expected a value in \[1, inf\], got {max_len}"):
        policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", max_len=max_len)


@pytest.mark.parametrize("estimator, options", [("grpo", {}), ("maxpo", {"k": 2, "normalize": "std"}),
                                                ("maxpo", {"k": 2}), ("pkpo", {"k": 2}),
                                                ("maxk_bon", {"k": 2}), ("passk_chen", {"k": 2})])
@pytest.mark.parametrize("eps, error", [(0.0, ValueError), (-0.577, ValueError), (float("nan"), ValueError),
                                        ("1e-6", TypeError)])
def test_estimators_reject_a_bad_eps(estimator, options, eps, error):
    from creditrl import compute_advantages
    with pytest.raises(error, match=r"eps: expected"):
        compute_advantages(estimator, rewards=torch.ones(4), mask=torch.ones(4, 2), group=torch.zeros(4, dtype=torch.long),
                           eps=eps, **options)


@pytest.mark.parametrize("n, c, k, error, message", [
    (4, "x", 2, TypeError, "c: expected an int"), (4, 2, None, TypeError, "k: expected an int"),
    (4, 2, True, TypeError, "k: expected an int"), (float("nan"), 2, 2, ValueError, "n: expected whole numbers"),
    (float("inf"), 2, 2, ValueError, "n: expected whole numbers"), (4, 1.5, 2, ValueError, "c: expected whole"),
    (4, 5, 2, ValueError, "c: expected 0 <= c <= n"), (4, 2, 0, ValueError, "k: expected 1 <= k <= n")])
def test_pass_at_k_checks_its_counts(n, c, k, error, message):
    from creditrl import pass_at_k
    with pytest.raises(error, match=message):
        pass_at_k(n, c, k)


@pytest.mark.parametrize("call", ["gamma", "lam", "temperature", "clip_low", "kl_coef"])
def test_non_numeric_scalars_name_the_argument(call):
    from creditrl import TraceOptions, compute_advantages, policy_loss, token_stats
    logp, old, adv, mask = _loss_inputs()
    with pytest.raises(TypeError, match=rf"{call}: expected a real number, got str"):
        if call == "gamma":
            compute_advantages("reinforce", rewards=torch.ones(2), mask=torch.ones(2, 2),
                               group=torch.zeros(2, dtype=torch.long), gamma="0.9")
        elif call == "lam":
            TraceOptions(lam="0.9")
        elif call == "temperature":
            token_stats(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), temperature="1")
        else:
            policy_loss(logp, old, adv, mask, **{call: "0.2"})


@pytest.mark.parametrize("value", [2, 0.5, -1])
def test_token_stats_follows_the_one_mask_rule(value):
    from creditrl import token_stats
    mask = torch.ones(2, 3)
    mask[1, 1] = value
    with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.*rows \[1\]"):
        token_stats(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), mask)


def test_minus_inf_logits_are_a_legal_masked_vocabulary():
    from creditrl import token_stats
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=g)
    banned = torch.zeros(2, 4, 7, dtype=torch.bool)
    banned[0, :, 5:] = True
    banned[1, 2, 0] = True
    tokens = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 1]])
    masked = logits.masked_fill(banned, float("-inf")).requires_grad_()
    stats = token_stats(masked, tokens)
    for name in ("logp", "entropy", "sum_p2", "energy"):
        assert torch.isfinite(getattr(stats, name)).all(), name
    # reference: the same distribution written the obvious way (the banned entries get probability 0)
    ref_logits = logits.masked_fill(banned, -1e4).double().requires_grad_()
    logq = torch.log_softmax(ref_logits, -1)
    q = logq.exp()
    ref_entropy = -(q * logq).sum(-1)
    ref_logp = logq.gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(stats.entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.sum_p2.double(), q.square().sum(-1), atol=1e-5, rtol=1e-5)
    (stats.logp.sum() + stats.entropy.sum()).backward()
    (ref_logp.sum() + ref_entropy.sum()).backward()
    assert torch.isfinite(masked.grad).all() and bool((masked.grad[banned] == 0).all())
    torch.testing.assert_close(masked.grad.double(), ref_logits.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_plus_inf_logits_raise_naming_the_positions(bad):
    from creditrl import token_stats
    from creditrl.utils.validate import NonFiniteError
    logits = torch.zeros(2, 3, 5)
    logits[1, 2, 3] = bad
    with pytest.raises(NonFiniteError, match=r"logits: 1 valid position\(s\) have NaN or \+inf .*rows \[1\]"):
        token_stats(logits, torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_apply_trace_refuses_non_finite_values_naming_rows(bad):
    from creditrl import apply_trace
    values = torch.zeros(3, 6)
    values[2, 5] = bad
    with pytest.raises(ValueError, match=r"values: 1 row\(s\) contain NaN or inf, e.g. rows \[2\]"):
        apply_trace(values, torch.ones(3, 6), lam=0.9)
    mask = torch.ones(3, 6)
    mask[2, 5] = 0                                        # off-mask garbage is ignored
    assert torch.isfinite(apply_trace(values, mask, lam=0.9)).all()


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches_give_defined_results(shape):
    import creditrl
    from creditrl import apply_trace, compute_advantages, list_estimators, policy_loss, token_stats
    from creditrl.core.losses import spurious_token_mask
    b, t = shape
    mask, group = torch.ones(b, t), torch.zeros(b, dtype=torch.long)
    for name in list_estimators():
        options = {"k": 2} if name in ("maxpo", "ei", "pkpo", "passk_chen", "maxk_bon") else {}
        adv = compute_advantages(name, rewards=torch.ones(b), mask=mask, group=group, energy=torch.ones(b, t),
                                 **options)
        assert adv.shape == shape and adv.dtype == torch.float32
    for options in ({}, {"stapo": True, "entropy": torch.ones(b, t)}, {"trace": creditrl.TraceOptions(lam=0.9)},
                    {"agg": "seq-mean-token-mean"}):
        logp = torch.zeros(b, t, requires_grad=True)
        loss, metrics = policy_loss(logp, torch.zeros(b, t), torch.zeros(b), mask, **options)
        loss.backward()
        assert float(loss.detach()) == 0.0 and logp.grad.shape == shape and set(metrics.values()) == {0.0}
    assert apply_trace(torch.zeros(b, t), mask, lam=0.9).shape == shape
    assert spurious_token_mask(torch.zeros(b, t), torch.ones(b, t), torch.ones(b), mask).shape == shape
    assert token_stats(torch.zeros(b, t, 4), torch.zeros(b, t, dtype=torch.long), mask).logp.shape == shape
    with pytest.raises(ValueError, match="advantages"):            # still validated when empty
        policy_loss(torch.zeros(b, t), torch.zeros(b, t), torch.zeros(b + 1), mask)


@pytest.mark.parametrize("logp_dtype, other_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32),
                                                     (torch.bfloat16, torch.float64)])
def test_mixed_float_dtypes_are_computed_in_the_wider_precision(logp_dtype, other_dtype):
    import creditrl
    from creditrl import policy_loss
    g = torch.Generator().manual_seed(0)
    base = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    options = dict(rollout_logp=base - 0.02, rollout_correction="tis", ref_logp=base + 0.01, kl_coef=0.1,
                   trace=creditrl.TraceOptions(lam=0.9))
    logp = base.to(logp_dtype).requires_grad_()
    loss, _ = policy_loss(logp, (base - 0.05).to(other_dtype), torch.tensor([1.0, -0.5, 2.0], dtype=other_dtype),
                          torch.ones(3, 6), **{k: v.to(other_dtype) if isinstance(v, torch.Tensor) else v
                                                for k, v in options.items()})
    loss.backward()
    ref_logp = base.to(logp_dtype).double().requires_grad_()     # the same inputs, all float64
    ref, _ = policy_loss(ref_logp, base - 0.05, torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64),
                         torch.ones(3, 6), **options)
    ref.backward()
    assert logp.grad.dtype == logp_dtype
    torch.testing.assert_close(loss.detach().double(), ref.detach(), rtol=1e-5, atol=1e-6)
    grad_tol = 1e-2 if logp_dtype == torch.bfloat16 else 1e-5          # the gradient is rounded to logp's dtype
    torch.testing.assert_close(logp.grad.double(), ref_logp.grad, rtol=grad_tol, atol=grad_tol)


def test_estimator_options_are_declared_once_and_agree_everywhere():
    from creditrl import compute_advantages, register_estimator
    from creditrl.core.estimators.registry import _REGISTRY, get_estimator

    @register_estimator("scaled_test_only")
    def scaled(batch, scale=2.0, *, shift):            # positional-or-keyword and keyword-only options
        return (batch.rewards - shift) * scale

    try:
        assert get_estimator("scaled_test_only").options == {"gamma": 1.0, "scale": 2.0,
                                                             "shift": __import__("inspect").Parameter.empty}
        common = dict(rewards=torch.ones(2), mask=torch.ones(2, 3), group=torch.arange(2))
        assert compute_advantages("scaled_test_only", scale=3.0, shift=0.5, **common)[0, 0] == 1.5
        with pytest.raises(ValueError, match=r"missing required option\(s\) \['shift'\]"):
            compute_advantages("scaled_test_only", **common)
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['k'\]; valid options are \['gamma', 'scale', 'shift'\]"):
            compute_advantages("scaled_test_only", shift=0.0, k=2, **common)
        with pytest.raises(ConfigError, match=r"algorithm.options: unknown option\(s\) \['k'\]; "
                                              r"valid options are \['gamma', 'scale', 'shift'\]"):
            resolve_config(load_config(None, ["algorithm.estimator=scaled_test_only", "algorithm.options.k=2"]))
    finally:
        _REGISTRY.pop("scaled_test_only", None)
