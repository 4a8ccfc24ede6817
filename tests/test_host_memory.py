"""The CLI's defaults for the CPU: large tensors in transparent huge pages, oneDNN's kernels kept; what they save."""

import subprocess
import sys

import pytest
import torch

from megaformer.cli import host_memory_defaults, kernel_cache_defaults
from megaformer.train.device import host_memory, kernel_thp_mode

# Allocates and frees a 64 MiB tensor five times and prints the page faults per allocation.
_FAULTS = """
import resource, torch
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(16 << 20)
before = faults()
for _ in range(5):
    torch.ones(16 << 20)
print((faults() - before) / 5)
"""


def _faults_per_allocation(thp: str) -> float:
    env = {"PATH": "/usr/bin:/bin", "THP_MEM_ALLOC_ENABLE": thp}
    return float(
        subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, check=True, env=env).stdout
    )


@pytest.mark.skipif(kernel_thp_mode() in ("never", "unknown"), reason="no transparent huge pages")
def test_huge_pages_fault_a_freed_and_reallocated_tensor_in_far_fewer_times():
    pages = (64 << 20) // 4096
    small, huge = _faults_per_allocation("0"), _faults_per_allocation("1")
    # glibc maps every 64 MiB allocation anew: each 4 KiB page faults again. Only where the kernel
    # gives huge pages when asked (madvise): in its "always" mode it gives them to the unaligned
    # mapping too (~32 faults of 2 MiB and the edges' small pages), which is what the variable asks.
    if kernel_thp_mode() == "madvise":
        assert small > 0.9 * pages, (small, huge)
    assert huge < 0.1 * pages, (small, huge)  # 2 MiB pages: 512 times fewer, where the kernel has them


@pytest.mark.parametrize(
    "defaults, variable, value, users",
    [
        (host_memory_defaults, "THP_MEM_ALLOC_ENABLE", "1", "0"),
        (kernel_cache_defaults, "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384", "1024"),
    ],
)
def test_the_cli_defaults_leave_the_users_setting_alone(defaults, variable, value, users):
    env: dict[str, str] = {}
    defaults(env)
    assert env == {variable: value}
    env = {variable: users}
    defaults(env)
    assert env == {variable: users}


# bf16 matmuls of 1,040 shapes (more than the 1,024 primitives oneDNN keeps by default),
# twice; oneDNN prints a line for each primitive it creates (profile_create).
_SHAPES = """
import torch
torch.set_num_threads(1)
w = torch.ones(64, 64, dtype=torch.bfloat16)
for _ in range(2):
    print("round", flush=True)
    for rows in range(1, 1041):
        torch.ones(rows, 64, dtype=torch.bfloat16) @ w
"""


def _kernels_created(extra: dict[str, str]) -> tuple[int, int]:
    """oneDNN's primitive-cache misses in the first and the second round of ``_SHAPES``."""
    env = {"PATH": "/usr/bin:/bin", "ONEDNN_VERBOSE": "profile_create", **extra}
    out = subprocess.run([sys.executable, "-c", _SHAPES], capture_output=True, text=True, check=True, env=env).stdout
    first, second = out.split("round\n")[1:]
    return first.count("create:cache_miss"), second.count("create:cache_miss")


def test_onednn_keeps_the_kernels_of_every_shape_it_met_under_the_cli_default():
    first, default = _kernels_created({})
    if first == 0:
        pytest.skip("torch runs bf16 matmuls without oneDNN on this CPU (no AVX512-BF16 or AMX)")
    env: dict[str, str] = {}
    kernel_cache_defaults(env)
    _, kept = _kernels_created(env)
    assert first >= 1000 and default == first  # 1,024 kept: each shape was evicted before it came round again
    assert kept == 0, kept


@pytest.mark.parametrize(
    "variable, kernel, said",
    [
        ("1", "always [madvise] never", "in transparent huge pages (THP_MEM_ALLOC_ENABLE=1, kernel: madvise)"),
        ("1", "always madvise [never]", "4 KiB pages: THP_MEM_ALLOC_ENABLE=1 but the kernel's transparent huge"),
        ("0", "always [madvise] never", "4 KiB pages (THP_MEM_ALLOC_ENABLE is not 1)"),
        (None, "always [madvise] never", "4 KiB pages (THP_MEM_ALLOC_ENABLE is not 1)"),
        ("0", "[always] madvise never", "huge pages where the kernel puts them (kernel: always;"),
        ("1", None, "in transparent huge pages (THP_MEM_ALLOC_ENABLE=1, kernel: unknown)"),
    ],
)
def test_the_log_says_which_pages_cpu_tensors_get(monkeypatch, tmp_path, variable, kernel, said):
    if variable is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", variable)
    mode = tmp_path / "enabled"
    if kernel is not None:
        mode.write_text(kernel + "\n")
    assert said in host_memory(torch.device("cpu"), mode)
    assert host_memory(torch.device("cuda", 0), mode) is None


def test_inductor_gets_a_cache_of_each_cpu_kernel_level(tmp_path):
    """Inductor's cache keys omit the vector ISA: AVX2 code reused under ATEN_CPU_CAPABILITY=default fails to build."""
    from megaformer.cli import compile_cache_defaults

    levels = {}
    for level in ("default", "avx2", "avx512"):
        env = {"ATEN_CPU_CAPABILITY": level}
        compile_cache_defaults(env)
        levels[level] = env["TORCHINDUCTOR_CACHE_DIR"]
        assert levels[level].endswith(f"isa-{level}")
    assert len(set(levels.values())) == 3
    # no level chosen: a folder of the CPU's own flags, never Inductor's shared default one
    native, other = tmp_path / "native", tmp_path / "other"
    native.write_text("processor : 0\nflags : fpu sse2 avx2 avx512f\n")
    other.write_text("processor : 0\nflags : fpu sse2 avx2\n")
    found = []
    for cpuinfo in (native, other, native):
        env = {}
        compile_cache_defaults(env, str(cpuinfo))
        found.append(env["TORCHINDUCTOR_CACHE_DIR"])
    assert found[0] == found[2] != found[1] and "isa-native-" in found[0]
    assert found[0] not in levels.values()
    mine = {"ATEN_CPU_CAPABILITY": "default", "TORCHINDUCTOR_CACHE_DIR": "/mine"}
    compile_cache_defaults(mine)
    assert mine["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    assert mine["TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD"] == "1"  # see test_compile.py
    off = {"TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD": "0"}
    compile_cache_defaults(off)
    assert off["TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD"] == "0"
