"""``train.precision=auto``: the rule (``choose_precision``) on given timings, and a run that
records what it timed and chose (config.yaml comment, summary, precision.json) with the probe's
timings forced, so the choice does not depend on the machine the tests run on."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from creditrl.config import load_config, load_saved_config
from creditrl.runtime.precision import AUTO_MARGIN, Precision, Probe, choose_precision, gradient_cosine


def fake_probe(seconds: dict[str, float], grads: dict[str, list] | None = None, calls: list | None = None):
    grads = grads or {"fp32": [torch.tensor([1.0, 2.0])], "bf16": [torch.tensor([1.0, 2.001])]}

    def run(precision: Precision) -> Probe:
        if calls is not None:
            calls.append(precision.name)
        return Probe(seconds[precision.name] / 2, seconds[precision.name] / 2, grads[precision.name])
    return run


@pytest.mark.parametrize("fp32, bf16, chosen", [(1.0, 0.5, "bf16"), (1.0, 2.0, "fp32"), (1.0, 1.0, "fp32"),
                                                (1.0, 1.0 - AUTO_MARGIN + 0.01, "fp32"),
                                                (1.0, 1.0 - AUTO_MARGIN - 0.01, "bf16")])
def test_auto_keeps_bf16_only_where_it_is_faster_by_the_margin(fp32, bf16, chosen):
    calls = []
    choice = choose_precision(fake_probe({"fp32": fp32, "bf16": bf16}, calls=calls), rounds=2)
    assert choice.chosen == chosen
    assert calls == ["fp32", "bf16", "fp32", "bf16", "bf16", "fp32"]      # warm-up, then interleaved, alternating
    assert choice.seconds["fp32"]["total"] == pytest.approx(fp32) and choice.seconds["bf16"]["total"] == pytest.approx(bf16)
    assert f"{fp32 / bf16:.2f}x as fast" in choice.text() and "rule: bf16 when" in choice.text()


def test_auto_keeps_fp32_where_the_bf16_gradient_disagrees():
    grads = {"fp32": [torch.tensor([1.0, 0.0]), None], "bf16": [torch.tensor([0.0, 1.0]), None]}
    choice = choose_precision(fake_probe({"fp32": 1.0, "bf16": 0.1}, grads))
    assert choice.chosen == "fp32" and choice.gradient_cosine == pytest.approx(0.0)
    assert "cosine with fp32's is 0.0000" in choice.reason


def test_auto_takes_the_best_of_the_rounds():
    """A busy machine only adds time: one slow round of bf16 does not decide."""
    times = iter([9.0, 9.0, 1.0, 5.0, 0.4, 1.0])           # warm-ups, then fp32 1.0 / bf16 5.0, bf16 0.4 / fp32 1.0

    def run(precision):
        t = next(times)
        return Probe(t, 0.0, [torch.ones(3)])
    choice = choose_precision(run, rounds=2)
    assert choice.chosen == "bf16" and choice.seconds["bf16"]["total"] == pytest.approx(0.4)


def test_gradient_cosine_against_a_loop():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(3, 4, generator=gen), None, torch.randn(5, generator=gen)]
    b = [torch.randn(3, 4, generator=gen), torch.randn(2, generator=gen), torch.randn(5, generator=gen)]
    flat_a = torch.cat([torch.zeros(2) if x is None else x.flatten() for x in (a[0], None, a[2])]).double()
    flat_b = torch.cat([x.flatten() for x in b]).double()
    want = float(flat_a[:12] @ flat_b[:12] + flat_a[14:] @ flat_b[14:]) / float(flat_a.norm() * flat_b.norm())
    assert gradient_cosine(a, b) == pytest.approx(want, rel=1e-12)


def test_unresolved_auto_names_who_resolves_it(tiny_chat_model_dir):
    from creditrl.recipe.resolve import precision_of
    from creditrl.trainer.update import Learner

    cfg = load_config(None, [f"model.name={tiny_chat_model_dir}", "train.precision=auto"])
    assert not precision_of(cfg).resolved and precision_of(cfg).frozen_dtype is None
    assert precision_of(load_config(None, ["train.precision=auto"])).name == "fp32"      # builtin:tiny: untimed
    with pytest.raises(ValueError, match="'auto' is resolved by creditrl's Trainer"):
        Learner(torch.nn.Linear(2, 2), cfg)


def run_config(model_dir, tmp_path, name, *extra):
    return load_config(None, [f"model.name={model_dir}", "task.name=addition",
                              "rollout.group_size=4", "rollout.prompts_per_step=1", "rollout.max_new_tokens=6",
                              "train.steps=1", "train.eval_problems=2", "train.eval_samples=1",
                              "train.save_every=0", "logging.progress=false", "logging.plots=false",
                              f"train.output_dir={tmp_path}", f"train.run_name={name}", *extra])


@pytest.mark.parametrize("bf16_seconds, chosen", [(0.5, "bf16"), (2.0, "fp32")], ids=["bf16-faster", "bf16-slower"])
def test_auto_run_records_both_timings_and_runs_what_it_chose(tiny_chat_model_dir, tmp_path, monkeypatch,
                                                              bf16_seconds, chosen):
    """The probe runs for real (decoding, forward+backward, gradients); only its clock is forced."""
    import creditrl.trainer.precision as auto
    from creditrl.trainer.loop import Trainer

    real = auto.model_probe
    forced = {"fp32": 1.0, "bf16": bf16_seconds}

    def timed(model, decode, forward_backward):
        run = real(model, decode, forward_backward)
        return lambda precision: dataclasses.replace(run(precision), decode_s=forced[precision.name] / 4,
                                                     train_s=forced[precision.name] * 3 / 4)
    monkeypatch.setattr(auto, "model_probe", timed)
    monkeypatch.setattr(auto, "matmul_precheck", lambda: None)     # the model's timing decides, on any CPU
    trainer = Trainer(run_config(tiny_chat_model_dir, tmp_path, chosen), progress=False)
    assert trainer.cfg.train.precision == chosen and trainer.learner.precision.name == chosen
    run = trainer.run()
    comment = (run / "config.yaml").read_text().splitlines()[0]
    assert comment.startswith(f"# train.precision=auto chose {chosen}:") and "fp32 1 s" in comment
    assert f"bf16 {bf16_seconds:g} s" in comment
    assert load_saved_config(run / "config.yaml").train.precision == chosen          # what the run did
    record = json.loads((run / "precision.json").read_text())
    assert record["chosen"] == chosen and record["seconds"]["bf16"]["total"] == pytest.approx(bf16_seconds)
    assert record["gradient_cosine"] > 0.99                                          # the real gradients agree
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == comment[2:]


@pytest.mark.parametrize("fp32, bf16, decided", [(1.0, 2.5, True), (1.0, 2.0, True), (1.0, 1.9, False),
                                                (1.0, 0.5, False), (0.0, 0.0, False)])
def test_the_matmul_precheck_decides_only_where_bf16_is_hopeless(fp32, bf16, decided):
    from creditrl.runtime.precision import HOPELESS, matmul_precheck

    choice = matmul_precheck(lambda: {"fp32": fp32, "bf16": bf16})
    assert (choice is not None) == decided and HOPELESS == 2.0
    if decided:
        assert choice.chosen == "fp32" and choice.gradient_cosine is None
        assert choice.seconds == {"fp32": {"matmul": fp32}, "bf16": {"matmul": bf16}}
        text = choice.text()
        assert text.startswith("train.precision=auto chose fp32: a 256x256 matrix product (best of 10) took fp32 ")
        assert f"{bf16 / fp32:.1f}x slower than fp32's" in text and "the model was not timed" in text


def test_matmul_seconds_times_both_precisions():
    from creditrl.runtime.precision import matmul_seconds

    times = matmul_seconds(size=32, rounds=2)
    assert set(times) == {"fp32", "bf16"} and all(0 < t < 10 for t in times.values())


def test_a_run_decided_by_the_precheck_records_its_timings(tiny_chat_model_dir, tmp_path, monkeypatch):
    import creditrl.trainer.precision as auto
    from creditrl.runtime.precision import matmul_precheck
    from creditrl.trainer.loop import Trainer

    monkeypatch.setattr(auto, "matmul_precheck", lambda: matmul_precheck(lambda: {"fp32": 0.001, "bf16": 0.03}))
    monkeypatch.setattr(auto, "measure_precision", lambda *a: pytest.fail("the model was timed"))
    trainer = Trainer(run_config(tiny_chat_model_dir, tmp_path, "pre"), progress=False)
    assert trainer.cfg.train.precision == "fp32"
    run = trainer.run()
    comment = (run / "config.yaml").read_text().splitlines()[0]
    assert comment.startswith("# train.precision=auto chose fp32: a 256x256 matrix product")
    assert "30.0x slower" in comment
    assert json.loads((run / "precision.json").read_text())["seconds"]["bf16"] == {"matmul": 0.03}


def test_probe_leaves_the_model_and_rngs_as_they_were(tiny_chat_model_dir):
    from creditrl.recipe.build import build_task, load_configured_policy
    from creditrl.trainer.precision import measure_precision

    cfg = run_config(tiny_chat_model_dir, "/unused", "x")
    task = build_task(cfg)
    model, tok = load_configured_policy(cfg, task, torch.device("cpu"), False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    rng = torch.random.get_rng_state()
    choice = measure_precision(cfg, model, tok, task)
    assert choice.chosen in ("fp32", "bf16") and set(choice.seconds) == {"fp32", "bf16"}
    assert all(s["decode"] > 0 and s["forward_backward"] > 0 for s in choice.seconds.values())
    assert torch.equal(torch.random.get_rng_state(), rng) and not model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_builtin_tiny_runs_fp32_untimed_and_says_so(tmp_path):
    from creditrl.trainer.loop import Trainer

    cfg = load_config(None, ["model.warm_start.max_steps=1", "model.warm_start.eval_size=4", "model.tiny.num_layers=1",
                             "train.steps=1", "rollout.prompts_per_step=1", "rollout.group_size=2",
                             "train.eval_problems=2", "train.eval_samples=1", "train.save_every=0",
                             "logging.progress=false", "logging.plots=false", f"train.output_dir={tmp_path}",
                             "train.run_name=tiny"])
    run = Trainer(cfg, progress=False).run()
    assert load_saved_config(run / "config.yaml").train.precision == "fp32"
    assert (run / "config.yaml").read_text().startswith("# train.precision=auto chose fp32, not timed: builtin:tiny")


def test_auto_with_low_precision_weights_records_the_dtype_they_compute_in(tmp_path):
    """model.dtype=bfloat16: the weights compute in bf16 whatever the autocast, so auto records bf16 and
    why (it recorded "chose fp32 ... fp32 is exact" for a run that computed in bf16); float32 weights
    keep the untimed fp32 record (model.dtype takes float32 or bfloat16 only)."""
    from creditrl.trainer.precision import resolve_precision

    cfg = load_config(None, ["model.dtype=bfloat16"])
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    resolved, choice = resolve_precision(cfg, model, None, None)
    assert (resolved.train.precision, choice.chosen, choice.seconds) == ("bf16", "bf16", {})
    assert "stored in bfloat16 (model.dtype)" in choice.text() and "exact" not in choice.text()
    untimed = resolve_precision(load_config(None, []), torch.nn.Linear(2, 2), None, None)[1]
    assert untimed.chosen == "fp32" and "fp32 is exact" in untimed.reason


def test_a_models_dropout_is_turned_off_and_the_run_says_so(tiny_chat_model_dir, tmp_path):
    """The sampler decodes in eval mode and the learner scores in train mode: with the config's
    dropout on, pi_theta / pi_old would be noise at unchanged weights. The trainer turns it off and
    says so in the run's notes (the summary)."""
    import json
    import shutil
    from creditrl.config import ConfigError
    from creditrl.recipe.resolve import resolve_config
    from creditrl.trainer.loop import Trainer

    model_dir = tmp_path / "dropout-model"
    shutil.copytree(tiny_chat_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    trainer = Trainer(run_config(model_dir, tmp_path, "dropout", "train.precision=fp32"), progress=False)
    assert trainer.model.config.attention_dropout == 0
    assert all(layer.self_attn.attention_dropout == 0 for layer in trainer.model.model.layers)
    assert any("base model's dropout is off (attention_dropout=0.1 set to 0)" in note for note in trainer.notes)
    plain = Trainer(run_config(tiny_chat_model_dir, tmp_path, "plain", "train.precision=fp32"), progress=False)
    assert not any("dropout" in note for note in plain.notes)
    lora = Trainer(run_config(tiny_chat_model_dir, tmp_path, "lora", "train.precision=fp32", "model.lora.enabled=true",
                              "model.lora.r=2", "model.lora.dropout=0.1"), progress=False)
    assert [note for note in lora.notes if "dropout" in note] == [
        "note: model.lora.dropout=0.1 stays on in the learner's forward passes (the sampler decodes without it): "
        "pi_theta / pi_old carries its noise, and a clip range acts on it too; 0 keeps the ratio exact at unchanged "
        "weights"]
    # and the top-p / rollout-correction combination is refused before any model loads
    with pytest.raises(ConfigError, match=r"loss.rollout_correction='tis' with rollout.top_p=0.9: top-p sampling is "
                                          r"itself the difference"):
        resolve_config(run_config(model_dir, tmp_path, "x", "rollout.top_p=0.9", "loss.rollout_correction=tis"))
