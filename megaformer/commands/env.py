"""``megaformer env [--json]``: the launch environment megaformer resolved, for debugging a launch.

Prints :func:`launcher.envinfo.resolve`: what :func:`launcher.env.detect` makes of the
variables torchrun, SLURM and the DeepSpeed launcher set (launcher kind, rank, local
rank, world size, node list, master address and port), and the device, backend and
threads a rank of this process would use. Run it inside the job (``srun megaformer env``)
to see what each task sees.
"""

from __future__ import annotations

import argparse
import json

from launcher.envinfo import resolve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object instead of aligned lines")


def main(args: argparse.Namespace) -> int:
    found = resolve()
    if args.json:
        print(json.dumps(found))
        return 0
    for key, value in found.items():
        if key == "nodes" and not value:  # a blank line said nothing
            value = ["(no SLURM node list: this host)"]
        print(f"{key:22} {','.join(value) if isinstance(value, list) else value}")
    return 0
