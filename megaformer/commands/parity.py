"""``megaformer parity``: a TP=N (x PP) model against the TP=1 model from the same seed.

``--tp`` and ``--pp`` set ``parallel.tp`` and ``parallel.pp`` of ``--config`` (by default the
config's own, after ``--set``; with ``parallel.dp=0``; TP=1 x PP=1 compares nothing and is
refused), and :func:`megaformer.parity.run_parity` runs the check: it starts tp x pp gloo
processes itself, or uses those torchrun, srun or the DeepSpeed launcher gave it. Exits
non-zero beyond ``--tolerance``.
"""

from __future__ import annotations

import argparse

from megaformer.cli_args import existing_file, finite_float, positive_int
from megaformer.config import load_config
from megaformer.errors import ConfigError
from megaformer.parity import ParitySettings, run_parity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=existing_file, required=True, help="YAML config (e.g. configs/tiny.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        help="tensor-parallel size to check against TP=1 (default: the config's)",
    )
    p.add_argument(
        "--pp",
        type=positive_int,
        default=None,
        help="pipeline stages to check against one (1F1B; default: the config's)",
    )
    p.add_argument(
        "--micro-batches",
        type=positive_int,
        default=None,
        help="with pp > 1: the batch's rows cut into this many (default 4)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="also split LayerNorm/dropout regions by sequence")
    p.add_argument(
        "--tolerance", type=finite_float(0.0), default=1e-5, help="largest relative difference accepted (fp32)"
    )
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--src-len", type=positive_int, default=24)
    p.add_argument("--tgt-len", type=positive_int, default=12)
    p.add_argument("--all", action="store_true", help="print every gradient, not only the worst ten")


def main(args: argparse.Namespace) -> int:
    given = [f"parallel.{k}={v}" for k, v in (("tp", args.tp), ("pp", args.pp)) if v is not None]
    configured = load_config(args.config, [*args.overrides, *given]).parallel
    tp, pp = configured.tp, configured.pp
    if tp * pp == 1:
        raise ConfigError(
            f"parity: tp=1 x pp=1 against TP=1 compares nothing ({args.config} sets parallel.tp=1, parallel.pp=1): "
            f"pass --tp N or --pp N"
        )
    if args.micro_batches is not None and pp == 1:
        raise ConfigError(
            "parity: --micro-batches cuts the batch for a pipeline, and this check has pp=1: pass --pp N or drop it"
        )
    if args.sequence_parallel and tp == 1:
        raise ConfigError(
            "parity: --sequence-parallel splits the sequence over TP ranks, and this check has tp=1: pass --tp N"
        )
    overrides = list(args.overrides) + [f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.dp=0"]
    if args.sequence_parallel:  # the parity batch's lengths are multiples of tp (checked): nothing is padded
        overrides = [f"parallel.pad_to_multiple={tp}", *overrides, "parallel.sequence_parallel=true"]
    cfg = load_config(args.config, overrides)
    settings = ParitySettings(
        batch=args.batch,
        src_len=args.src_len,
        tgt_len=args.tgt_len,
        micro_batches=args.micro_batches or ParitySettings.micro_batches,
        tolerance=args.tolerance,
        show_all=args.all,
    )
    return run_parity(cfg, settings)
