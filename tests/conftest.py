"""Shared test set-up: the repository root on sys.path and a cached extension folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Should DeepSpeed JIT-compile an op (megaformer builds none: engine.py's _without_shm_op), the tests keep
# it out of the user's cache.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
# The tests run on the CPU, also on a machine with GPUs: test workers set parallel.backend=gloo
# (tests/test_cpu_backend.py checks that they do), and DeepSpeed, which would otherwise pick
# its CUDA accelerator whenever CUDA is visible, uses its CPU one; spawned ranks and
# subprocesses inherit this.
os.environ["DS_ACCELERATOR"] = "cpu"
# The suite starts its own ranks and SLURM jobs: run from a shell inside a SLURM allocation or a
# torchrun rank, every test would inherit that job's variables (a `--nproc 2` run refuses SLURM_PROCID).
_LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
for _name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_")) or n in _LAUNCH]:
    del os.environ[_name]
# Inductor's cache does not tell CPU kernel levels apart: one folder per ATEN_CPU_CAPABILITY (as the CLI does).
from megaformer.cli import compile_cache_defaults  # noqa: E402

compile_cache_defaults()
# Under pytest-xdist (`make test`) the workers share the cores: each worker's in-process torch
# and the commands it starts take their share of the threads instead of all of them each
# (OpenMP threads that outnumber the cores spin against each other).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))


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


@pytest.fixture(scope="module")
def synthetic_data(tmp_path_factory):
    """A prepared directory of the built-in corpus (300 pairs, shards of 100), once per test file."""
    from megaformer import cli

    out = tmp_path_factory.mktemp("data") / "data"
    assert cli.main(["prepare", "--synthetic", "300", "--out", str(out), "--shard-size", "100", "--quiet"]) == 0
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


# `make test` spreads whole files over pytest-xdist workers (--dist loadfile), so that a file's
# session fixtures (the cluster, the shared training runs) are built once. Files start in this
# order, the longest first, so that none of them is left to run alone at the end (the Makefile passes
# --no-loadscope-reorder: by default xdist reorders files by their number of tests).
LONGEST_FIRST = ("test_slurm_cluster", "test_compile", "test_train", "test_pipeline", "test_budget")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: tests keep their order inside a file
