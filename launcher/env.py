"""One rank description from whatever started this process.

| environment | recognised by | rank / local rank / world size | master address and port |
| --- | --- | --- | --- |
| torchrun, the DeepSpeed launcher | ``RANK`` and ``WORLD_SIZE`` | ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` | ``MASTER_ADDR`` / ``MASTER_PORT`` |
| SLURM ``srun`` | ``SLURM_PROCID`` inside a job step | ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` | first host of ``SLURM_STEP_NODELIST`` (or the job's), port from the job id |
| a plain process | neither | 0 / 0 / 1 | 127.0.0.1, a free port |

The result is exported as the variables torchrun would set, so ``torch.distributed``'s
``env://`` initialisation works the same everywhere. This is the one place that reads
the environment: nothing below ``megaformer/`` does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from megaformer.errors import ConfigError


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


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list: ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(prefix + part)
    return [h for h in (h.strip() for h in hosts) if h]


def _int(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ConfigError(f"environment variable {name}={env.get(name)!r} is not an integer") from None


def detect(env: dict | None = None) -> RankInfo:
    """The rank description of this process (see the module docstring)."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        info = RankInfo(
            _int(env, "RANK"),
            _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            _int(env, "WORLD_SIZE"),
            env.get("MASTER_ADDR", "127.0.0.1"),
            _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
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
            _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + job % 20000,
            "slurm",
        )
    else:  # one process: a free port, so that two single-process runs on a machine do not collide
        from launcher.local import free_port

        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else free_port()
        return RankInfo(0, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")
    if not 0 <= info.rank < info.world_size or not 0 <= info.local_rank < info.world_size:
        raise ConfigError(
            f"{info.source}: rank {info.rank} / local rank {info.local_rank} outside world size {info.world_size}"
        )
    return info
