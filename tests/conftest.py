"""Shared test set-up: the repository root on sys.path and a cached extension folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# DeepSpeed JIT-compiles an op on its first init_distributed; keep the build between runs.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
# The tests run on the CPU, also on a machine with GPUs: test workers set parallel.backend=gloo
# (tests/test_cpu_backend.py checks that they do), and DeepSpeed, which would otherwise pick
# its CUDA accelerator whenever CUDA is visible, uses its CPU one; spawned ranks and
# subprocesses inherit this.
os.environ["DS_ACCELERATOR"] = "cpu"
# Inductor's cache does not tell CPU kernel levels apart: one folder per ATEN_CPU_CAPABILITY (as the CLI does).
from megaformer.cli import compile_cache_defaults  # noqa: E402

compile_cache_defaults()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A prepared synthetic corpus (1,500 pairs) shared by the training tests."""
    out = tmp_path_factory.mktemp("corpus") / "synthetic"
    proc = subprocess.run(
        [sys.executable, "-m", "megaformer.cli", "prepare", "--synthetic", "1500", "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def run(capsys):
    """megaformer.cli.main(argv) -> (status, stdout, stderr); argparse's SystemExit becomes a status."""

    from megaformer import cli

    def call(*argv):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as stop:
            code = stop.code
        out, err = capsys.readouterr()
        return code, out, err

    return call
