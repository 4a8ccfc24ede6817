"""megaformer: train, decode and evaluate the Transformer of "Attention Is All You Need".

One sub-command per job, each in the module that owns it.

Every sub-command module exposes ``add_arguments(parser)`` and ``main(args) -> int``.
Errors derived from :class:`megaformer.errors.MegaformerError` are printed on one line
(naming the file, line or setting) and end the process with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megaformer.errors import MegaformerError

# name -> (module, one-line help); modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("megaformer.data.prepare", "clean parallel text, train sentencepiece, write webdataset shards"),
    "inspect": ("megaformer.data.inspect", "summarise a prepared data directory"),
    "info": ("megaformer.info", "parameters, FLOPs and memory of a config"),
    "parity": ("megaformer.parity", "check a TP=N model against TP=1 on this installation"),
    "train": (
        "megaformer.train.command",
        "train (torchrun, srun, the deepspeed launcher, or --nproc N local processes)",
    ),
    "reshard": ("megaformer.train.command:reshard", "rewrite a checkpoint for another tensor-parallel size"),
    "export": ("megaformer.train.command:export", "write one consolidated, TP-independent model file"),
    "translate": ("megaformer.decode.translate", "translate raw text with a checkpoint or model file (beam search)"),
    "evaluate": ("megaformer.decode.evaluate_command", "translate a test set and score it with sacreBLEU and chrF"),
    "average": ("megaformer.decode.average_command", "average the parameters of several checkpoints, as in the paper"),
    "env": ("launcher.envinfo", "the launch environment megaformer resolved: rank, nodes, master, device"),
}


def _entry(spec: str, function: str):
    """``module`` -> module.function; ``module:prefix`` -> module.prefix_function (several commands in one module)."""
    module, _, prefix = spec.partition(":")
    name = f"{prefix}_{function}" if prefix else function
    if prefix and function == "add_arguments":
        name = f"add_{prefix}_arguments"
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the requested sub-parser when possible: importing every command pulls in torch.
    parser = argparse.ArgumentParser(
        prog="megaformer",
        description=__doc__.splitlines()[0],
        epilog="Run megaformer COMMAND --help for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == wanted:
            _entry(module, "add_arguments")(p)
    args = parser.parse_args(argv)
    try:
        return int(_entry(args._module, "main")(args) or 0)
    except MegaformerError as err:
        print(f"megaformer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megaformer {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early: not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
