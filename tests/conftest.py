"""Test-suite wide settings.

Warm-started ``builtin:tiny`` models go to a fresh per-session cache, so a run never depends on
(or pollutes) the user's ~/.cache/creditrl: every test passes from a clean machine. Set
CREDITRL_TEST_CACHE to reuse a directory across runs while developing.

Device-sensitive tests carry the ``cuda`` marker (``make test-gpu`` runs them alone); without a
CUDA device they are skipped, and pytest counts them as skipped. The ``device`` fixture runs a
test once on the CPU and once on CUDA (that case marked ``cuda``).
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    """Each device a test must hold on: the CPU, and CUDA when one is present."""
    return torch.device(request.param)


@pytest.fixture(scope="session", autouse=True)
def _isolated_model_cache(tmp_path_factory):
    old = os.environ.get("CREDITRL_CACHE")
    os.environ["CREDITRL_CACHE"] = os.environ.get("CREDITRL_TEST_CACHE") or str(tmp_path_factory.mktemp("creditrl-cache"))
    yield
    if old is None:
        os.environ.pop("CREDITRL_CACHE", None)
    else:
        os.environ["CREDITRL_CACHE"] = old


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory):
    """A local model directory: a random 1-layer Llama + a character tokenizer over printable
    ASCII with a ChatML chat template (so it counts as a chat model), context 1024."""
    import string

    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model

    path = tmp_path_factory.mktemp("tiny-chat-model")
    tokenizer = char_tokenizer(string.printable, model_max_length=1024)
    tokenizer.chat_template = CHATML
    config = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                             max_position_embeddings=1024)
    tiny_model(tokenizer, config, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
