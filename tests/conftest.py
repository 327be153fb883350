"""Test-suite wide settings.

Warm-started ``builtin:tiny`` models go to a fresh per-session cache, so a run never depends on
(or pollutes) the user's ~/.cache/creditrl: every test passes from a clean machine. Set
CREDITRL_TEST_CACHE to reuse a directory across runs while developing.

``--threads N`` (or ``CREDITRL_TEST_THREADS=N``) runs every test with N torch CPU threads, set
before each test (code under test may change the count: the trainer sets ``train.threads``) and
exported as ``OMP_NUM_THREADS`` to child processes; ``make test-portable`` uses it with one thread.
Under pytest-xdist (``make test`` runs ``-n auto``) each worker's default is its share of the cores.

The tests whose assertions rest on floating-point tolerances or sampled statistics carry the
``numerics`` marker (``NUMERIC_FILES``): CI runs them again under other CPU kernels and thread counts
(``.ci/run``); ``make test-portable`` runs the whole suite under each setting.

Property tests (hypothesis) draw fresh examples on every run; ``HYPOTHESIS_PROFILE=ci`` (set by
``.ci/run``) derandomises them: each test's examples come from a hash of the test, so CI's verdict on
a commit is reproducible, and a failure prints the blob that replays it.

Device-sensitive tests carry the ``cuda`` marker (``make test-gpu`` runs them alone); without a
CUDA device they are skipped, and pytest counts them as skipped. The ``device`` fixture runs a
test once on the CPU and once on CUDA (that case marked ``cuda``).
"""
import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

HAS_CUDA = torch.cuda.is_available()
THREADS = torch.get_num_threads()   # replaced by --threads / CREDITRL_TEST_THREADS in pytest_configure


def pytest_addoption(parser):
    parser.addoption("--threads", type=int, default=None, metavar="N",
                     help="torch CPU threads for every test (default: $CREDITRL_TEST_THREADS, else torch's default)")


def pytest_configure(config):
    global THREADS
    chosen = config.getoption("--threads") or os.environ.get("CREDITRL_TEST_THREADS")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))   # set in each pytest-xdist worker
    if chosen:
        THREADS = int(chosen)
        if THREADS < 1:
            raise pytest.UsageError(f"--threads: expected an int >= 1, got {THREADS}")
    elif workers > 1:   # the cores shared out: workers each on every core would oversubscribe OpenMP
        THREADS = max(1, THREADS // workers)
    if chosen or workers > 1:
        os.environ["OMP_NUM_THREADS"] = str(THREADS)   # child interpreters (CLI runs, compare --jobs)


def pytest_report_header(config):
    return (f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{THREADS} thread(s) per test")


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the session's thread count, whatever the tests before it set."""
    torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _estimator_registry():
    """An estimator a test defines and registers (a function of the test's own, ``<locals>``) is gone
    after it, and a built-in it overwrote is back, so tests that list the registry do not depend on
    the order tests run in. Estimators of imported modules stay: importing them again would not
    register them again."""
    from creditrl.core.estimators.registry import _REGISTRY, list_estimators
    list_estimators()                                  # the built-ins, registered before the snapshot
    before = dict(_REGISTRY)
    yield
    for name, spec in list(_REGISTRY.items()):
        if "<locals>" in getattr(spec.fn, "__qualname__", "") and spec is not before.get(name):
            if name in before:
                _REGISTRY[name] = before[name]
            else:
                del _REGISTRY[name]


# files of estimators, losses, token statistics, gradients and statistics: the arithmetic that differs
# across CPU kernels and thread counts (the rest checks control flow, files and messages)
NUMERIC_FILES = {
    "test_estimators.py", "test_estimators_menu.py", "test_leave_one_out.py", "test_maxk.py", "test_traces.py",
    "test_stapo.py", "test_losses.py", "test_loss_terms.py", "test_policy_gradients.py",
    "test_policy_loss_reference.py", "test_surrogates.py", "test_entropy_terms.py", "test_kl_and_truncation.py",
    "test_delta_l_norm.py", "test_token_stats.py", "test_fused_checks.py", "test_group_gradients.py",
    "test_gradient_quality.py", "test_evidence_rules.py", "test_synthetic_policy.py", "test_safe_math.py",
    "test_integration_verl.py", "test_diagnose.py", "test_sampling_controls.py", "test_time_to_accuracy.py",
}


def pytest_collection_modifyitems(config, items):
    numerics = pytest.mark.numerics
    for item in items:
        if item.path.name in NUMERIC_FILES:
            item.add_marker(numerics)
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
    cache = os.environ.get("CREDITRL_TEST_CACHE")
    if not cache and os.environ.get("PYTEST_XDIST_WORKER"):
        # one cache for the run's workers (their base folders share a parent): a warm start is made once,
        # and entries are written atomically, so two workers making one at once both end with a whole entry
        cache = tmp_path_factory.getbasetemp().parent / "creditrl-cache"
        cache.mkdir(exist_ok=True)
    os.environ["CREDITRL_CACHE"] = str(cache or tmp_path_factory.mktemp("creditrl-cache"))
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
