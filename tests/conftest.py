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
