"""One rank description from whatever started this process.

| environment | recognised by | rank / local rank / world size | master address and port |
| --- | --- | --- | --- |
| torchrun, the DeepSpeed launcher | ``RANK`` and ``WORLD_SIZE`` | ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` | ``MASTER_ADDR`` / ``MASTER_PORT`` |
| SLURM ``srun`` | ``SLURM_PROCID`` inside a job step | ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` | first host of ``SLURM_STEP_NODELIST`` (or the job's), port from the job id |
| a plain process | neither | 0 / 0 / 1 | 127.0.0.1, a free port |

The result is exported as the variables torchrun would set, so ``torch.distributed``'s
``env://`` initialisation works the same everywhere. This is the one place that reads
the launch environment, ``SLURM_JOB_ID`` included (:func:`slurm_job`: the job to requeue, to
name in the run directory's lock and in a checkpoint). Below ``megaformer/``, ``parity.py``
reads the variables exported here, and ``demo.py`` passes the environment on to its child
processes; nothing else does.

Host lists come from ``scontrol show hostnames`` where SLURM is installed, and from
:func:`parse_hostlist` (every form SLURM documents) where it is not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from megaformer.errors import ConfigError

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what RankInfo.export sets
MAX_HOSTS = 100_000  # more nodes than any cluster has: a node list naming more is refused before it is expanded


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"

    def export(self) -> None:
        """Set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for ``env://``."""
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK=str(self.local_rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def _split_top(text: str) -> list[str]:
    """Split at the commas that are outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ConfigError(f"host list {text!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"host list {text!r}: unbalanced brackets")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _range_count(body: str, hostlist: str) -> int:
    """How many values ``01-03,7`` holds (4), without making them; a malformed range is a ConfigError."""
    count = 0
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"host list {hostlist!r}: bad range {part!r}")
        if sep and int(hi) < int(lo):
            raise ConfigError(f"host list {hostlist!r}: range {part!r} runs backwards")
        count += int(hi) - int(lo) + 1 if sep else 1
    return count


def host_count(hostlist: str) -> int:
    """How many hosts :func:`parse_hostlist` would name, counted without expanding the list."""
    total = 0
    for expr in _split_top(hostlist):
        names = 1
        for _, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", expr):
            if body:
                names *= _range_count(body, hostlist)
        total += names
    return total


def _refuse_too_many(hostlist: str, count: int) -> None:
    """``n[0-99999999]`` would be a hundred million names before anything could say it is wrong."""
    if count > MAX_HOSTS:
        raise ConfigError(
            f"host list {hostlist!r} names {count:,} hosts, more than any cluster ({MAX_HOSTS:,}): "
            f"check SLURM_STEP_NODELIST / SLURM_JOB_NODELIST"
        )


def _expand_range(body: str, hostlist: str) -> list[str]:
    """``01-03,7`` -> 01 02 03 7: each range keeps the width of its lower bound (zero padding)."""
    values: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"host list {hostlist!r}: bad range {part!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ConfigError(f"host list {hostlist!r}: range {part!r} runs backwards")
        values.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return values


def parse_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compact host list without SLURM, in SLURM's order.

    Commas outside brackets separate host expressions; inside brackets they separate
    ranges. An expression may hold several bracket groups, with text before, between and
    after them, and expands to their product, the leftmost varying slowest:
    ``rack[1-2]-node[01-02]`` -> rack1-node01 rack1-node02 rack2-node01 rack2-node02;
    ``node[1-2]-ib`` -> node1-ib node2-ib; ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1.
    A range keeps the width of its lower bound (``[098-101]`` -> 098 099 100 101).
    With three or more bracket groups Slurm 22.05 uses an order of its own (``a[1-2]b[1-2]c[1-2]``:
    a1b1c1 a1b1c2 a2b1c1 ...); the hosts and the first host (the master) are the same.
    A list of more than :data:`MAX_HOSTS` hosts is refused before it is expanded.
    """
    _refuse_too_many(hostlist, host_count(hostlist))
    hosts: list[str] = []
    for expr in _split_top(hostlist):
        names = [""]
        for text, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", expr):
            names = [n + text for n in names]
            if body:
                names = [n + v for n in names for v in _expand_range(body, hostlist)]
        hosts.extend(names)
    return hosts


def expand_nodelist(nodelist: str, scontrol: str | None = None) -> list[str]:
    """The host names of a SLURM node list: ``scontrol show hostnames`` where SLURM is installed
    (it knows every form its own version writes), :func:`parse_hostlist` where it is not."""
    scontrol = scontrol if scontrol is not None else shutil.which("scontrol")
    if scontrol:
        try:
            count = host_count(nodelist)
        except ConfigError:  # a form of this SLURM version that only scontrol reads
            count = 0
        _refuse_too_many(nodelist, count)  # scontrol too would print every name of an absurd list
        try:
            proc = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
            if proc.returncode == 0 and proc.stdout.split():
                return proc.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return parse_hostlist(nodelist)


def _int(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ConfigError(f"environment variable {name}={env.get(name)!r} is not an integer") from None


def _port(env: dict, default: int) -> int:
    """``MASTER_PORT`` if set (a TCP port, 1-65535), else ``default``."""
    if "MASTER_PORT" not in env:
        return default
    port = _int(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ConfigError(f"environment variable MASTER_PORT={port} is not a TCP port: set it in 1-65535, or unset it")
    return port


def detect(env: dict | None = None) -> RankInfo:
    """The rank description of this process (see the module docstring)."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        info = RankInfo(
            _int(env, "RANK"),
            _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            _int(env, "WORLD_SIZE"),
            env.get("MASTER_ADDR", "127.0.0.1"),
            _port(env, 29500),
            "torchrun",
        )
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_nodelist(nodelist)
        if not hosts:
            raise ConfigError("running under srun but SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is empty")
        job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        info = RankInfo(
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            _int(env, "SLURM_NTASKS") if "SLURM_NTASKS" in env else len(hosts),
            env.get("MASTER_ADDR", hosts[0]),
            _port(env, 20000 + job % 20000),
            "slurm",
        )
    else:  # one process: a free port, so that two single-process runs on a machine do not collide
        from launcher.local import free_port

        port = _port(env, 0) or free_port()
        return RankInfo(0, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")
    if not 0 <= info.rank < info.world_size or not 0 <= info.local_rank < info.world_size:
        raise ConfigError(
            f"{info.source}: rank {info.rank} / local rank {info.local_rank} outside world size {info.world_size}"
        )
    return info


def slurm_job(env: dict | None = None) -> tuple[str | None, int]:
    """The SLURM job of this process and which attempt of it this is (``SLURM_RESTART_COUNT``, 0 for the first);
    (None, 0) outside SLURM."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or None
    return job, _int(env, "SLURM_RESTART_COUNT") if job and "SLURM_RESTART_COUNT" in env else 0


def parse_tasks_per_node(spec: str) -> list[int]:
    """SLURM's ``SLURM_TASKS_PER_NODE`` form, ``2(x3),1`` -> [2, 2, 2, 1]: how many tasks each node runs."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise ConfigError(f"tasks per node {spec!r}: expected SLURM's form, e.g. 2(x3),1")
        repeat = int(match.group(2) or 1)
        if repeat > MAX_HOSTS:
            _refuse_too_many(spec, repeat)
        counts.extend([int(match.group(1))] * repeat)
    return counts
