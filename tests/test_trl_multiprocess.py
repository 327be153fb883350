"""CreditGRPOTrainer in two processes on the CPU (gloo), launched with accelerate.

accelerate 1.15's ``launch --cpu --num_processes 2`` starts a single process (its simple
launcher); two CPU processes come from ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu
--num_processes 2`` (torchrun underneath, gloo because of ACCELERATE_USE_CPU) — docs/trl.md.

For ``otb`` and ``maxpo``: every generation batch's advantages, concatenated over the two
processes, equal ``compute_advantages`` run once (single process) on the same gathered
rewards, groups, masks and energies (<= 1e-6); creditrl's metrics in TRL's log are the mean of
the two processes' values, logged once per step (not once per process).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

import torch  # noqa: E402

from tolerances import EPS32, sum_rtol  # noqa: E402
import creditrl  # noqa: E402
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "trl_two_process.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_mp")
    tokenizer = char_tokenizer("abcdefgh0123456789+= ")
    cfg = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=64)
    tiny_model(tokenizer, cfg, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def launch(model_dir: Path, out: Path, estimator: str) -> list[dict]:
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    port = str(29500 + os.getpid() % 1000)
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--main_process_port", port, str(SCRIPT), str(model_dir), str(out),
           estimator]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("estimator", ["otb", "maxpo"])
def test_two_processes_match_one(model_dir, tmp_path, estimator):
    ranks = launch(model_dir, tmp_path, estimator)
    assert [r["world"] for r in ranks] == [2, 2]
    options = {"k": 2} if estimator == "maxpo" else {}
    for step, (a, b) in enumerate(zip(ranks[0]["rollouts"], ranks[1]["rollouts"])):
        # both processes saw the same gathered rewards, groups and estimator mask
        for key in ("rewards", "group", "estimator_mask"):
            torch.testing.assert_close(a[key], b[key])
        local = [a["advantages"], b["advantages"]]
        width = max(x.shape[1] for x in local)
        advantages = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in local])
        energy = torch.cat([torch.nn.functional.pad(r["energy"], (0, width - r["energy"].shape[1]))
                            for r in (a, b)])
        mask = a["estimator_mask"][:, :width]
        single = creditrl.compute_advantages(estimator, rewards=a["rewards"], mask=mask, group=a["group"],
                                             energy=energy if estimator == "otb" else None, **options)
        # the same gathered inputs, computed in each process (its own thread split): float32 group sums over
        # <= 4 completions x 8 tokens of rewards <= 8 (count_digits) (tests/tolerances.py)
        assert (advantages - single).abs().max() <= sum_rtol(32 + 8) * 8, f"step {step}"
        assert a["group"].numel() == 2 * a["advantages"].shape[0]        # each process holds half the batch
    # metrics: averaged over the two processes and logged once per step by the main process
    history = [h for h in ranks[0]["log_history"] if "creditrl/advantage_abs_mean" in h]
    train = [[m for mode, m in r["metrics"] if mode == "train" and "advantage_abs_mean" in m] for r in ranks]
    assert len(history) == len(train[0]) == len(train[1]) == 2
    for logged, m0, m1 in zip(history, *train):
        expected = (m0["advantage_abs_mean"] + m1["advantage_abs_mean"]) / 2
        # float32 metrics averaged over the processes: a few roundings of values of the same sign
        assert logged["creditrl/advantage_abs_mean"] == pytest.approx(expected, rel=4 * EPS32)
