"""The code's shape, checked: layers import only downwards, no function is longer than 60 lines,
imports sit at the top of a file except optional (or deliberately lazy) dependencies, the package
never imports the research distribution, experiments never import each other or the trainer's
internals, public imports are light and change no global state, loading a config imports no
torch, and each estimator fact is declared once and read everywhere."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "creditrl"
RESEARCH = ROOT / "research" / "creditrl_research"
MAX_FUNCTION_LINES = 60
# optional dependencies, imported where they are needed so creditrl works without them; and
# transformers, imported only where a model is in hand, so `creditrl.diagnose` loads without it
OPTIONAL = ("trl", "verl", "peft", "gguf", "reasoning_gym", "wandb", "trackio", "tensorboard", "math_verify",
            "torch.utils.tensorboard", "accelerate", "pyarrow", "datasets", "matplotlib", "transformers.cache_utils")
# layer of each top-level part (lower number = lower layer); a module may import its own layer or below
LAYERS = {"utils": 0, "config": 1, "core": 2, "tasks": 3, "runtime": 4, "recipe": 5, "trainer": 6, "tools": 7,
          "integrations": 7, "cli": 8}


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def part(path_or_module: Path | str) -> str:
    if isinstance(path_or_module, Path):
        rel = path_or_module.relative_to(SRC).with_suffix("")
        return rel.parts[0] if rel.parts[0] != "__init__" else "__init__"
    return path_or_module.split(".")[1] if path_or_module.count(".") else "__init__"


def imported(tree: ast.AST) -> list[tuple[str, ast.AST, bool]]:
    """(module, node, at top level) of every import of a creditrl or optional module."""
    top = {id(n) for n in getattr(tree, "body", [])}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node, id(node) in top))
    return out


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_layers_import_downwards(path):
    mine = part(path)
    if mine not in LAYERS:
        return
    for name, node, _ in imported(ast.parse(path.read_text())):
        if name.startswith("creditrl.") and part(name) in LAYERS:
            assert LAYERS[part(name)] <= LAYERS[mine], f"{path.name}:{node.lineno} imports {name} (a higher layer)"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_at_the_top_except_optional_dependencies(path):
    for name, node, at_top in imported(ast.parse(path.read_text())):
        optional = any(name == o or name.startswith(o + ".") for o in OPTIONAL)
        assert at_top or optional, f"{path.name}:{node.lineno} imports {name} inside a block"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_functions_are_short(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{path.name}:{node.lineno} {node.name} has {length} lines"


def test_the_package_never_imports_research():
    for path in modules():
        for name, node, _ in imported(ast.parse(path.read_text())):
            assert not name.startswith("creditrl_research"), f"{path.name}:{node.lineno} imports {name}"


def test_experiments_import_no_sibling_and_no_trainer_internal():
    folder = RESEARCH / "experiments"
    assert len(list(folder.glob("*.py"))) >= 8
    siblings = {p.stem for p in folder.glob("*.py")} - {"__init__", "registry", "runner"}   # the protocol
    for path in folder.glob("*.py"):
        if path.name == "__init__.py":        # registers every experiment, in the report's order
            continue
        for name, node, _ in imported(ast.parse(path.read_text())):
            assert not name.startswith("creditrl.trainer"), f"{path.name}:{node.lineno} imports {name}"
            if name.startswith("creditrl_research.experiments."):
                assert name.rsplit(".", 1)[-1] not in siblings, f"{path.name}:{node.lineno} imports {name}"
            if name == "creditrl_research.experiments" and isinstance(node, ast.ImportFrom):
                assert not {a.name for a in node.names} & siblings, f"{path.name}:{node.lineno} imports a sibling"


def test_loading_a_config_imports_no_torch():
    code = "import sys, creditrl.config as c; c.load_config(None, ['optim.lr=1e-5']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


PUBLIC = ["compute_advantages", "policy_loss", "token_stats", "diagnose", "register_estimator", "register_loss_term",
          "list_estimators", "PolicyLoss", "StapoOptions"]
HEAVY = ("matplotlib", "tensorboard", "transformers", "creditrl_research", "creditrl.trainer", "creditrl.recipe",
         "trl", "verl")


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_are_light_and_change_no_global_state(name):
    """``import creditrl; creditrl.<name>`` loads none of HEAVY and leaves matplotlib's backend, torch's
    threads and default dtype, and the warnings filters as they were."""
    code = f"""
import sys, warnings, json
import matplotlib
matplotlib.use("svg")                       # a user's own choice, which creditrl must keep
import torch
before = (matplotlib.get_backend(), torch.get_num_threads(), torch.get_default_dtype(), list(warnings.filters))
loaded = set(sys.modules)
import creditrl
getattr(creditrl, {name!r})
after = (matplotlib.get_backend(), torch.get_num_threads(), torch.get_default_dtype(), list(warnings.filters))
heavy = sorted(m for m in set(sys.modules) - loaded if m.split(".")[0] in {HEAVY!r} or m.startswith({HEAVY!r}))
print(json.dumps([before == after, heavy]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    unchanged, heavy = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert unchanged, "a public import changed global state"
    assert not [m for m in heavy if m.split(".")[0] in ("matplotlib", "tensorboard", "transformers", "trl", "verl",
                                                        "creditrl_research") or m.startswith(("creditrl.trainer",
                                                                                              "creditrl.recipe"))], heavy


def test_compute_advantages_imports_torch_and_the_core_only():
    code = ("import sys; import creditrl; creditrl.compute_advantages; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('creditrl.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert set(eval(out.stdout)) <= {"core", "utils"}, out.stdout


def test_the_cli_imports_a_command_only_when_it_runs():
    code = ("import sys; from creditrl import cli; cli.main(['--help']); "
            "print('torch' in sys.modules, 'rich' in sys.modules, any(m.startswith('creditrl.trainer') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False False False"
    code = ("import sys; from creditrl import cli; cli.main(['estimators']); "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('creditrl.') and m.count('.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert not {"trainer", "runtime", "tasks"} & set(eval(out.stdout.strip().splitlines()[-1])), out.stdout[-500:]


@pytest.mark.parametrize("args", [["train.steps=abc"], ["train.steps=3.0"], ["--steps=5"], ["optim.lr=-1"]])
def test_a_refused_train_command_loads_no_torch(args):
    """`creditrl train` checks its arguments and config before the trainer (torch, transformers: ~6 s on
    a 2-core CPU) loads, so a typo is refused at once."""
    code = ("import sys\nfrom creditrl import cli\ntry:\n    rc = cli.main(['train', *%r])\n"
            "except SystemExit as stop:\n    rc = stop.code\n"
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)" % (args,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "2 False False", out.stdout + out.stderr[-1000:]


def test_a_new_estimator_is_one_local_change():
    """One file (tests/plugins/top_half_estimator.py) declares an estimator and its facts; the config
    checks, `creditrl estimators`, the reference, diagnose's plan and TRL's config read them, with no
    list to edit anywhere."""
    code = """
import sys, io, contextlib
sys.path.insert(0, "tests/plugins")
import top_half_estimator  # noqa: F401  (registers it)
from creditrl.config import load_config
from creditrl.core.estimators import get_estimator
from creditrl.core.estimators.labels import all_labels, takes_k
from creditrl.recipe import reference
from creditrl.recipe.resolve import resolve_config
from creditrl.tools import estimators
spec = get_estimator("top_half_test_only")
assert spec.needs_energy and spec.token_level and spec.leave_one_out and spec.k_range.text() == "2 <= k < N"
assert "top_half_test_only+loo" in all_labels(2) and "top_half_test_only" not in all_labels(None)
assert takes_k("top_half_test_only+loo")
assert "needs the energies" in reference.markdown().split("### `top_half_test_only`")[1].split("###")[0]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    estimators.main([])
assert "top_half_test_only" in out.getvalue() and "2 <= k < N" in out.getvalue()
try:
    resolve_config(load_config(None, ["algorithm.estimator=top_half_test_only", "algorithm.options.k=8"]))
except ValueError as err:
    assert "top_half_test_only needs 2 <= k < rollout.group_size (=8)" in str(err), err
else:
    raise AssertionError("k = N accepted")
cfg = resolve_config(load_config(None, ["algorithm.estimator=top_half_test_only", "algorithm.options.k=3",
                                        "algorithm.options.gamma=0.9"]))
assert cfg.algorithm.options == {"gamma": 0.9, "k": 3, "leave_one_out": False}
from creditrl.integrations.trl import CreditGRPOConfig
try:
    CreditGRPOConfig(output_dir="/tmp/x", advantage_estimator="top_half_test_only", maxk_k=4, num_generations=4,
                     per_device_train_batch_size=4, use_cpu=True, bf16=False)
except ValueError as err:
    assert "top_half_test_only needs 2 <= k < num_generations (=4)" in str(err), err
else:
    raise AssertionError("TRL accepted k = N")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
