"""The launch environment megaformer resolved, for debugging a launch (printed by ``megaformer env``).

:func:`resolve` gives what :func:`launcher.env.detect` makes of the variables torchrun,
SLURM and the DeepSpeed launcher set (launcher kind, rank, local rank, world size, node
list, master address and port), and the device, backend and threads a rank of this
process would use (started by torchrun or srun; ``megaformer train --nproc N`` gives each of
its N ranks the cores divided by N). The command is :mod:`megaformer.commands.env`.
"""

from __future__ import annotations

import os

from launcher.env import detect, expand_nodelist


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
        "threads": torch.get_num_threads(),  # a rank of this process (OMP_NUM_THREADS, else torch's default)
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_cpus_per_task": env.get("SLURM_CPUS_PER_TASK"),
    }
