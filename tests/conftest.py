"""Test-suite wide settings.

Warm-started ``builtin:tiny`` models go to a fresh per-session cache, so a run never depends on
(or pollutes) the user's ~/.cache/creditrl: every test passes from a clean machine. Set
CREDITRL_TEST_CACHE to reuse a directory across runs while developing.
"""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_model_cache(tmp_path_factory):
    old = os.environ.get("CREDITRL_CACHE")
    os.environ["CREDITRL_CACHE"] = os.environ.get("CREDITRL_TEST_CACHE") or str(tmp_path_factory.mktemp("creditrl-cache"))
    yield
    if old is None:
        os.environ.pop("CREDITRL_CACHE", None)
    else:
        os.environ["CREDITRL_CACHE"] = old
