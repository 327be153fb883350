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
    import safetensors.torch

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
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
        load_config(None, [override])


@pytest.mark.parametrize("value", ["1e-9", "0", "0.01", "11", "-1"])
def test_temperature_has_a_documented_range(value):
    with pytest.raises(ConfigError, match=r"rollout.temperature: expected a value (in \[0.05, 10.0\]|> 0)"):
        load_config(None, [f"rollout.temperature={value}"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "otb", "opo"])
def test_group_size_one_is_an_error_that_says_why(estimator):
    with pytest.raises(ConfigError, match=r"rollout.group_size: 1 response per prompt .* nothing would be learned"):
        load_config(None, ["rollout.group_size=1", f"algorithm.estimator={estimator}"])
    load_config(None, ["rollout.group_size=1", "algorithm.estimator=reinforce"])   # learns from one response


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
    start = time.perf_counter()
    assert task.reward(Problem("a", "42"), huge) == 1.0
    assert time.perf_counter() - start < 5
    captured = capfd.readouterr()
    assert "frac" not in captured.err and "frac" not in captured.out


def test_non_finite_rewards_count_as_zero_and_are_logged():
    from creditrl.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.trainer import generate_rollouts
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
    metrics = Learner(model, cfg).update(batch, torch.Generator().manual_seed(0))
    assert metrics["reward_invalid_frac"] == 0.5 and metrics["skipped_updates"] == 0


# ----------------------------------------------------------------------------- non-finite updates

def test_non_finite_gradient_never_reaches_the_weights():
    from creditrl.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.trainer import generate_rollouts
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
    metrics = Learner(model, cfg).update(batch, torch.Generator().manual_seed(0))
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
    monkeypatch.setattr(loop, "train", stop)
    monkeypatch.setattr("creditrl.trainer.train", stop)
    assert main(["train", "--no-progress", f"train.output_dir={tmp_path}"]) == 2
    assert "training stopped at step 3" in capsys.readouterr().err
    assert Path(tmp_path).exists()
