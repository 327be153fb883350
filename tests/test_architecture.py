"""The code's shape, checked: layers import only downwards, no function is longer than 60 lines,
imports sit at the top of a file except optional dependencies, experiments never import each
other or the trainer's internals, and loading a config imports no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "creditrl"
MAX_FUNCTION_LINES = 60
# optional dependencies, imported where they are needed so creditrl works without them
OPTIONAL = ("trl", "verl", "peft", "gguf", "reasoning_gym", "wandb", "trackio", "tensorboard", "math_verify",
            "torch.utils.tensorboard", "accelerate", "pyarrow", "datasets")
# layer of each top-level part (lower number = lower layer); a module may import its own layer or below
LAYERS = {"utils": 0, "config": 1, "core": 2, "tasks": 3, "runtime": 4, "trainer": 5, "studies": 6,
          "integrations": 6, "reference": 7, "cli": 8}


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


def test_experiments_import_no_sibling_and_no_trainer_internal():
    folder = SRC / "studies" / "experiments"
    siblings = {p.stem for p in folder.glob("*.py")} - {"__init__", "registry", "runner"}   # the protocol
    for path in folder.glob("*.py"):
        if path.name == "__init__.py":        # registers every experiment, in the report's order
            continue
        for name, node, _ in imported(ast.parse(path.read_text())):
            assert not name.startswith("creditrl.trainer"), f"{path.name}:{node.lineno} imports {name}"
            if name.startswith("creditrl.studies.experiments."):
                assert name.rsplit(".", 1)[-1] not in siblings, f"{path.name}:{node.lineno} imports {name}"
            if name == "creditrl.studies.experiments" and isinstance(node, ast.ImportFrom):
                assert not {a.name for a in node.names} & siblings, f"{path.name}:{node.lineno} imports a sibling"


def test_loading_a_config_imports_no_torch():
    code = "import sys, creditrl.config as c; c.load_config(None, ['optim.lr=1e-5']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
