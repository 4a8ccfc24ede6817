"""Shared test set-up: the repository root on sys.path and a cached extension folder."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# DeepSpeed JIT-compiles an op on its first init_distributed; keep the build between runs.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
# The tests run on the CPU, also on a machine with GPUs: test workers set parallel.backend=gloo
# (tests/test_cpu_backend.py checks that they do), and DeepSpeed, which would otherwise pick
# its CUDA accelerator whenever CUDA is visible, uses its CPU one; spawned ranks and
# subprocesses inherit this.
os.environ["DS_ACCELERATOR"] = "cpu"
