"""In-training diagnosis: the sliding window's statistics against a written-out loop over pairs of
groups, `creditrl train logging.diagnose_every` end to end on builtin:tiny (metrics, summary.md,
plot, cost; nothing logged as NaN), its refusals before any work, and TRL's DiagnoseCallback on
GRPOTrainer and CreditGRPOTrainer."""
from __future__ import annotations

import json
import math

import pytest
import torch

from creditrl.config import ConfigError, load_config
from creditrl.core.gradients.window import StepWindow
from creditrl.recipe.resolve import resolve_config
from creditrl.trainer.loop import train

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.warm_start.max_steps=400", "model.warm_start.eval_every=25", "model.warm_start.eval_size=32",
        "model.warm_start.target_accuracy=0.3", "model.warm_start.lr=3e-3", "task.options.digits=1", "train.threads=1"]


def test_window_statistics_match_a_loop_over_pairs_of_groups():
    gen = torch.Generator().manual_seed(0)
    names = ("reference", "a", "b")
    steps = [torch.randn(n, 3, 5, generator=gen, dtype=torch.float64) + torch.tensor([0.5, 0.4, 0.7])[:, None]
             for n in (3, 4, 2, 5)]
    window = StepWindow(names, size=3)
    for g in steps:
        window.add(g)
    kept = steps[1:]                                               # the window holds the last 3 steps

    def estimates(parts):
        """Each step's own mean E[g g^T] and mean product of ordered pairs of different groups,
        averaged over the steps with weights n_s / sum n."""
        draws = sum(g.shape[0] for g in parts)
        second, signal = torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)
        for g in parts:
            n = g.shape[0]
            second += n / draws * sum(torch.einsum("ne,nf->ef", g[:, :, d], g[:, :, d]) for d in range(5)) / n
            products = sum(g[i] @ g[j].T for i in range(n) for j in range(n) if i != j)
            signal += n / draws * products / (n * (n - 1))
        return second, signal

    second, signal = estimates(kept)
    quality = window.quality("reference", "b")
    variance = torch.diagonal(second - signal)
    scale = signal[:, 0] / signal[0, 0]
    matched = variance / scale.square()
    for e, name in enumerate(names):
        assert quality[name].scale.value == pytest.approx(float(scale[e]), rel=1e-10)
        assert quality[name].efficiency.value == pytest.approx(float(matched[2] / matched[e]), rel=1e-10)
    # the jackknife replicate leaving out the middle step, written out
    replicate = estimates([kept[0], kept[2]])
    sub_scale = replicate[1][:, 0] / replicate[1][0, 0]
    assert window._replicates()[1][2, 1, 0] / window._replicates()[1][2, 0, 0] == pytest.approx(float(sub_scale[1]))
    noise = window.noise_scale("a")
    assert noise.value == pytest.approx(float(variance[1] / signal[1, 1]), rel=1e-10)
    assert len(window.steps) == 3 and noise.folds == 3


def test_window_variance_is_unbiased_when_steps_differ_in_size_and_mean():
    """The mean gradient moves between steps (3·1, then 0) of 2 and 12 groups, each group's gradient
    having tr Cov = D: the window's V averages to D. (Pooling the pair products over all pairs made
    it 2.15 D here.) Monte Carlo over 1,500 windows, bound 5 standard errors of the mean."""
    gen = torch.Generator().manual_seed(0)
    D, reps = 10, 1500
    values = []
    for _ in range(reps):
        window = StepWindow(("reference",), size=2)
        window.add(3.0 + torch.randn(2, 1, D, generator=gen, dtype=torch.float64))
        window.add(torch.randn(12, 1, D, generator=gen, dtype=torch.float64))
        second, signal = window._replicates()
        values.append(float(second[0, 0, 0] - signal[0, 0, 0]))
    values = torch.tensor(values, dtype=torch.float64)
    assert abs(float(values.mean()) - D) < 5 * float(values.std()) / reps ** 0.5


def test_unknown_diagnosed_estimators_are_refused_before_the_model_loads():
    with pytest.raises(ConfigError, match=r"logging.diagnose_estimators: .*nope"):
        resolve_config(load_config(None, ["logging.diagnose_every=2", "logging.diagnose_estimators=[rloo,nope]"]))
    with pytest.raises(ConfigError, match=r"logging.diagnose_estimators: 'maxpo' is a max@K estimator"):
        resolve_config(load_config(None, ["logging.diagnose_every=2", "logging.diagnose_estimators=[maxpo]"]))
    with pytest.raises(ConfigError, match=r"logging.diagnose_every: the mean gradient .* rollout.prompts_per_step >= 2, got 1"):
        load_config(None, ["logging.diagnose_every=2", "rollout.prompts_per_step=1"])
    with pytest.raises(ConfigError, match=r"logging.diagnose_estimators: given \(\['grpo'\]\), but the in-training "
                                          r"diagnosis is off \(logging.diagnose_every=0\), so it would do nothing"):
        resolve_config(load_config(None, ["logging.diagnose_estimators=[grpo]"]))


@pytest.mark.slow
def test_train_with_diagnose_every_on_builtin_tiny(tmp_path):
    cfg = load_config(None, [*TINY, "train.steps=8", "train.eval_every=0", "logging.diagnose_every=2",
                             "logging.diagnose_estimators=[rloo,grpo]", "rollout.prompts_per_step=12",
                             "rollout.group_size=4", "logging.report_to=[jsonl]", f"train.output_dir={tmp_path}",
                             "train.run_name=r", "logging.progress=false"])
    run = train(cfg, progress=False)
    text = (run / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    records = [json.loads(line) for line in text.splitlines()]
    diagnosed = [m for m in records if "time_diagnose" in m]
    assert [m["step"] for m in diagnosed] == [2, 4, 6, 8]
    assert all(not any(k.startswith("diagnose/") for k in m) for m in records if m not in diagnosed)
    assert [m["diagnose/steps"] for m in diagnosed] == [1, 2, 3, 4]
    assert all("diagnose/rloo/efficiency" not in m for m in diagnosed[:1])     # one step: no interval, not logged
    for m in diagnosed:
        for label in ("rloo", "grpo"):
            if f"diagnose/{label}/efficiency_low" in m:
                assert m[f"diagnose/{label}/efficiency_low"] <= m[f"diagnose/{label}/efficiency"] <= \
                    m[f"diagnose/{label}/efficiency_high"]
            if f"diagnose/{label}/cosine" in m:
                assert -1 <= m[f"diagnose/{label}/cosine"] <= 1
    summary = (run / "summary.md").read_text()
    assert "## In-training diagnosis" in summary and "| `rloo` |" in summary and "| `grpo` |" in summary
    assert "a diagnosed step costs" in summary and "nan" not in summary.lower().replace("nanos", "")
    assert (run / "plots" / "diagnose.png").is_file() or not any("diagnose/rloo/efficiency" in m for m in diagnosed)
    import yaml
    assert "diagnose" not in yaml.safe_load((run / "config.yaml").read_text())      # no diagnose section


def test_step_diagnosis_metrics_leave_out_what_is_undefined():
    from creditrl.core.losses import PolicyLoss
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.step_diagnosis import StepDiagnosis, compared_rows
    model = tiny_model(char_tokenizer("ab+="), TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2,
                                                               intermediate_size=32))
    rows = compared_rows("otb", {}, ["rloo", "grpo"], None)
    diagnosis = StepDiagnosis(model, rows, "otb", PolicyLoss(), temperature=1.0, window=4, groups=8)
    assert diagnosis.labels == ["rloo", "grpo"] and diagnosis.space.kind == "all"
    gen = torch.Generator().manual_seed(1)
    mean = torch.tensor([1.0, 0.9, 1.0, 1.1])[:, None] * torch.ones(4, 6)
    for _ in range(4):               # a resolved signal: every number defined
        diagnosis.window.add(mean + 0.3 * torch.randn(8, 4, 6, generator=gen, dtype=torch.float64))
    metrics = diagnosis.metrics()
    for label in ("rloo", "grpo"):
        assert metrics[f"diagnose/{label}/efficiency_low"] <= metrics[f"diagnose/{label}/efficiency"] <= \
            metrics[f"diagnose/{label}/efficiency_high"]
        assert -1 <= metrics[f"diagnose/{label}/cosine_low"] <= metrics[f"diagnose/{label}/cosine"] <= \
            metrics[f"diagnose/{label}/cosine_high"] <= 1      # an estimate at 1 is read with its interval
    assert metrics["diagnose/noise_scale"] > 0 and metrics["diagnose/steps"] == 4
    empty = StepDiagnosis(model, rows, "otb", PolicyLoss(), temperature=1.0, window=4, groups=8)
    empty.window.add(0.3 * torch.randn(8, 4, 6, generator=gen, dtype=torch.float64))   # no signal, one step
    assert set(empty.metrics()) <= {"diagnose/steps", "diagnose/noise_scale"}


# ---------------------------------------------------------------- TRL


@pytest.fixture(scope="module")
def trl_model(tmp_path_factory):
    pytest.importorskip("trl")
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    path = tmp_path_factory.mktemp("tiny_llama_callback")
    tokenizer = char_tokenizer("abcdefgh0123456789+= ")
    tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                          max_position_embeddings=64), seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def count_digits(completions, **kwargs):
    return [float(sum(c.isdigit() for c in text)) for text in completions]


@pytest.mark.slow
@pytest.mark.parametrize("credit", [False, True], ids=["GRPOTrainer", "CreditGRPOTrainer"])
def test_trl_callback_logs_the_diagnosis(trl_model, tmp_path, credit):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from creditrl.integrations.trl import CreditGRPOConfig, CreditGRPOTrainer, DiagnoseCallback

    config, trainer_class = (CreditGRPOConfig, CreditGRPOTrainer) if credit else (GRPOConfig, GRPOTrainer)
    extra = {"advantage_estimator": "otb"} if credit else {}
    args = config(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=4, max_completion_length=8,
                  max_steps=4, learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                  save_strategy="no", seed=0, **extra)
    trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(trl_model), reward_funcs=count_digits,
                            args=args, train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "12", "ef"] * 4}),
                            processing_class=AutoTokenizer.from_pretrained(trl_model))
    callback = DiagnoseCallback(trainer, every=1, estimators=["rloo", "dr_grpo"])
    trainer.add_callback(callback)
    trainer.train()
    logged = [m for m in trainer.state.log_history if "time_diagnose" in m]
    assert len(logged) == 4 and [m["diagnose/steps"] for m in logged] == [1, 2, 3, 4]
    assert callback.diagnosis.configured == ("otb" if credit else "grpo")
    assert not any(isinstance(v, float) and math.isnan(v) for m in logged for v in m.values())
    assert "| `rloo` |" in callback.summary() and "| `dr_grpo` |" in callback.summary()
    with pytest.raises(ValueError, match=r"every: expected an integer >= 1, got 0"):
        DiagnoseCallback(trainer, every=0)
