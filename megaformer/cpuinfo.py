"""What this CPU is (/proc/cpuinfo) and the process's choice of fp32 matmul library; no torch imported.

``MEGAFORMER_CPU_MATMUL`` (see :mod:`megaformer.parallel.cpu_matmul`) is checked here, so that every
command refuses a wrong value in one line before it starts, torch or not.
"""

from __future__ import annotations

import os
from pathlib import Path

from megaformer.errors import ConfigError

CPUINFO = Path("/proc/cpuinfo")
MATMUL_CHOICES = ("auto", "onednn", "blas")


def cpu_field(name: str, cpuinfo: Path = CPUINFO) -> str:
    """The first processor's ``name`` line of /proc/cpuinfo (``vendor_id``, ``flags``), empty where unknown."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags, empty where unknown."""
    return set(cpu_field("flags", cpuinfo).split())


def matmul_setting(environ: dict[str, str] = os.environ) -> str:
    """``MEGAFORMER_CPU_MATMUL``: auto (unset), onednn or blas; a ConfigError naming it otherwise."""
    choice = environ.get("MEGAFORMER_CPU_MATMUL", "auto")
    if choice not in MATMUL_CHOICES:
        raise ConfigError(f"MEGAFORMER_CPU_MATMUL={choice!r}: expected one of {', '.join(MATMUL_CHOICES)}")
    return choice
