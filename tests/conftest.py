"""Shared test set-up: the repository root on sys.path and a cached extension folder."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# DeepSpeed JIT-compiles an op on its first init_distributed; keep the build between runs.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
