"""The suite runs on the CPU with gloo, also on a machine where CUDA is visible.

``parallel.backend=auto`` picks nccl whenever CUDA is available, and nccl refuses the CPU
tensors the test workers hand to collectives. Every test worker therefore sets the gloo
backend itself (which also puts the run on the CPU device); these checks fail when a
worker or a ``megaformer train/parity`` subprocess in the tests does not.
"""

import ast
from pathlib import Path

import pytest
import torch

from megaformer.config import ParallelConfig, load_config
from megaformer.parallel import ParallelContext

TESTS = Path(__file__).resolve().parent
GLOO_MARKS = ('backend="gloo"', "parallel.backend=gloo")


def _functions(tree: ast.AST):
    """Every function, innermost last (a nested helper is checked on its own source)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _starts_processes(node: ast.AST) -> str | None:
    """What in ``node`` would pick a backend: a ParallelContext.initialize call or a train/parity command."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "initialize":
            if isinstance(sub.func.value, ast.Name) and sub.func.value.id == "ParallelContext":
                return "ParallelContext.initialize"
        if isinstance(sub, ast.List):
            words = [e.value for e in sub.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if "megaformer.cli" in words and ("train" in words or "parity" in words):
                return "a megaformer train/parity subprocess"
    return None


def _offenders() -> list[str]:
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        for fn in _functions(tree):
            what = _starts_processes(fn)
            first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])  # parametrised configs count
            source = "\n".join(text.splitlines()[first - 1 : fn.end_lineno])
            if what and not any(mark in source for mark in GLOO_MARKS):
                found.append(f"{path.name}:{fn.lineno} {fn.name}: {what} without parallel.backend=gloo")
    return found


def test_every_test_worker_forces_gloo():
    assert _offenders() == []


def test_the_check_notices_a_worker_without_gloo(tmp_path, monkeypatch):
    """The scan is not vacuous: a worker like the real ones, minus gloo, is reported."""
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "def _worker():\n"
        "    cfg = load_config(TINY, ['parallel.tp=2'])\n"
        "    ctx = ParallelContext.initialize(cfg.parallel, 0, 2)\n"
        "def test_cmd():\n"
        "    run([sys.executable, '-m', 'megaformer.cli', 'train', '--config', 'x'])\n"
    )
    monkeypatch.setattr(__import__(__name__), "TESTS", tmp_path)
    assert [line.split(":")[0] for line in _offenders()] == ["test_bad.py", "test_bad.py"]


def test_decode_command_tests_hide_cuda():
    """translate/evaluate --tp have no backend option: their tests run with CUDA hidden."""
    text = (TESTS / "test_decode_commands.py").read_text()
    assert '"--tp"' in text and 'setenv("CUDA_VISIBLE_DEVICES", "")' in text


@pytest.fixture
def cuda_visible(monkeypatch):
    """This process as if a GPU were visible (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def test_gloo_keeps_the_cpu_where_cuda_is_visible(cuda_visible):
    auto = ParallelContext.initialize(ParallelConfig(), 0, 1)
    assert (auto.backend, auto.device.type) == ("nccl", "cuda")  # what an unmarked worker would get
    forced = ParallelContext.initialize(ParallelConfig(backend="gloo"), 0, 1)
    assert (forced.backend, forced.device) == ("gloo", torch.device("cpu"))
    tiny = load_config(TESTS.parent / "configs" / "tiny.yaml", ["parallel.backend=gloo"])
    assert ParallelContext.initialize(tiny.parallel, 0, 1).device == torch.device("cpu")
