"""``megaformer env [--json]``: the launch environment megaformer resolved, for debugging a launch.

Prints what :func:`launcher.env.detect` makes of the variables torchrun, SLURM and the
DeepSpeed launcher set (launcher kind, rank, local rank, world size, node list, master
address and port), and the device, backend and threads a rank of this process would use.
Run it inside the job (``srun megaformer env``) to see what each task sees.
"""

from __future__ import annotations

import argparse
import json
import os

from launcher.env import detect, expand_nodelist


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object instead of aligned lines")


def resolve(env: dict[str, str] | None = None) -> dict[str, object]:
    """The resolved launch environment as one flat dict (see the module docstring)."""
    import torch

    from megaformer.parallel.groups import pick_device

    env = dict(os.environ if env is None else env)
    info = detect(env)
    kind = info.source
    if kind == "torchrun" and "TORCHELASTIC_RUN_ID" not in env and "SLURM_PROCID" not in env:
        kind = "torchrun or the deepspeed launcher"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return {
        "launcher": kind,
        "rank": info.rank,
        "local_rank": info.local_rank,
        "world_size": info.world_size,
        "nodes": expand_nodelist(nodelist) if nodelist else [],
        "master_addr": info.master_addr,
        "master_port": info.master_port,
        "device": str(pick_device(backend, info.local_rank)),
        "backend": backend,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "omp_num_threads": env.get("OMP_NUM_THREADS"),
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_cpus_per_task": env.get("SLURM_CPUS_PER_TASK"),
    }


def main(args: argparse.Namespace) -> int:
    found = resolve()
    if args.json:
        print(json.dumps(found))
        return 0
    for key, value in found.items():
        print(f"{key:22} {','.join(value) if isinstance(value, list) else value}")
    return 0
