"""megaformer: train, decode and evaluate the Transformer of "Attention Is All You Need".

One sub-command per job, each a module of :mod:`megaformer.commands`, registered in :data:`COMMANDS`.

Every sub-command module exposes ``add_arguments(parser)`` and ``main(args) -> int``.
Errors derived from :class:`megaformer.errors.MegaformerError`, and argument errors
(:mod:`megaformer.cli_args` checks every number and path as it is parsed), are printed
on one line naming the option, file or setting, and end the process with status 2; no
traceback.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import importlib
import os
import sys
import tempfile
from dataclasses import dataclass
from types import ModuleType
from typing import NoReturn

from megaformer import logs
from megaformer.cpuinfo import matmul_setting
from megaformer.errors import MegaformerError
from megaformer.files import PATH_ERRNOS, STATE_ERRNOS, path_refusal


@dataclass(frozen=True)
class Command:
    """A sub-command: the module that defines it (imported only when the command runs) and its help line.

    ``add`` and ``main`` name the module's two functions (``add_arguments`` and ``main`` in every command).
    """

    name: str
    module: str
    help: str
    add: str = "add_arguments"
    main: str = "main"

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


COMMANDS: tuple[Command, ...] = (
    Command(
        "prepare", "megaformer.commands.prepare", "clean parallel text, train sentencepiece, write webdataset shards"
    ),
    Command("inspect", "megaformer.commands.inspect", "summarise a prepared data directory"),
    Command("info", "megaformer.commands.info", "parameters, FLOPs and memory of a config"),
    Command("plan", "megaformer.commands.plan", "the fastest layout of a config that fits a cluster"),
    Command("parity", "megaformer.commands.parity", "check a TP=N model against TP=1 on this installation"),
    Command(
        "train",
        "megaformer.commands.train",
        "train (torchrun, srun, the deepspeed launcher, or --nproc N local processes)",
    ),
    Command("reshard", "megaformer.commands.reshard", "rewrite a checkpoint for another tensor-parallel size"),
    Command(
        "export",
        "megaformer.commands.export",
        "write the model as safetensors, Hugging Face MarianMT or CTranslate2",
    ),
    Command("translate", "megaformer.commands.translate", "translate raw text with a checkpoint or model file"),
    Command(
        "evaluate",
        "megaformer.commands.evaluate",
        "translate a test set and score it, or score --hyp: sacreBLEU, chrF, the paper's tokenized BLEU",
    ),
    Command("average", "megaformer.commands.average", "average the parameters of several checkpoints"),
    Command(
        "env", "megaformer.commands.env", "the launch environment megaformer resolved: rank, nodes, master, device"
    ),
    Command(
        "multi30k", "megaformer.commands.multi30k", "the Multi30k recipe: prepare, train for minutes, average, score"
    ),
    Command(
        "wmt14",
        "megaformer.commands.wmt14",
        "the WMT'14 en-de recipe: prepare from the downloads, train, average, score",
    ),
)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``megaformer CMD: error: ...``) and status 2, as for our own errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(wanted: str | None = None) -> Parser:
    """The parser with every sub-command; only ``wanted``'s options are added ("*" adds them all).

    Adding a command's options imports its module, and most modules import torch:
    ``megaformer --help`` and one command stay quick.
    """
    parser = Parser(
        prog="megaformer",
        description=(__doc__ or "").splitlines()[0],
        epilog="Run megaformer COMMAND --help for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        p.set_defaults(_command=command)
        p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors (no progress)")
        p.add_argument("-v", "--verbose", action="store_true", help="debug messages too")
        if wanted in (command.name, "*"):
            getattr(command.load(), command.add)(p)
    return parser


def host_memory_defaults(environ: dict[str, str] = os.environ) -> None:
    """Large CPU tensors in transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE``) unless the environment says otherwise.

    glibc's malloc gives every allocation above 32 MiB a mapping of its own and unmaps it
    when freed, so the largest tensors of a CPU step (the fp32 logits, tokens x
    vocabulary x 4 bytes: 45 MiB for a Multi30k micro-batch) fault in every 4 KiB page
    again, every micro-batch: ~26,000 page faults a step for ``configs/multi30k.yaml`` on
    one thread. With the variable set, torch aligns allocations of 2 MiB or more to 2 MiB
    and asks the kernel for huge pages there (``madvise``): 512 times fewer faults. torch
    reads it once, at its first allocation, so it is set here, before any command imports
    torch; ranks started by ``--nproc``, torchrun or srun from this process inherit it.
    ``THP_MEM_ALLOC_ENABLE=0`` keeps torch's 4 KiB pages.
    """
    environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def kernel_cache_defaults(environ: dict[str, str] = os.environ) -> None:
    """oneDNN keeps the kernels of 16,384 matmul shapes (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) unless the environment says otherwise.

    On a CPU with AVX512-BF16 or AMX, torch runs bf16 matmuls through oneDNN, which
    generates a kernel (a primitive) for each shape it meets (milliseconds each on one
    thread) and keeps the last 1,024. A translation batch's shapes change with its
    sentences' lengths: a Multi30k rank meets ~120 new (batch, source, target) shapes an
    epoch, ~40 primitives each (the linears' forward and two backward matmuls, attention's
    batched ones), so the default cache was emptied within a few steps and every step
    created ~17 primitives again (``ONEDNN_VERBOSE=profile_create``: 6,857 in 200 steps of
    2 ranks). With room for 16,384 the shapes seen once stay: after the first epoch ~1.4
    a step remain, and the run trained 1.06-1.27x the target tokens/s. oneDNN reads the
    variable at its first primitive, so it is set here, before any command imports
    torch; ranks inherit it. A GPU run never uses it.
    """
    environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")


def compile_cache_defaults(environ: dict[str, str] = os.environ, cpuinfo: str = "/proc/cpuinfo") -> None:
    """Inductor's kernel cache in a folder of this CPU kernel level, and AOTAutograd's for the layers (what the user set is kept).

    Inductor (torch 2.13) keys its cache without the vector ISA: code generated under the
    AVX2 or AVX-512 kernels is reused under ``ATEN_CPU_CAPABILITY=default``, where its
    ``at::vec`` calls do not compile, and code generated under a capped level is reused at
    the CPU's own level. The folder is named by ``ATEN_CPU_CAPABILITY`` when it is set and
    otherwise by the CPU's feature flags, so no level ever loads another's kernels, not even
    from Inductor's shared default folder that runs of other levels filled before.

    AOTAutograd's cache also takes graphs holding the layers' autograd Functions (the
    compiled ReLU, the TP collectives): torch bypasses it for them by default, as a Python
    backward may do what the graph does not show, but Dynamo traces these backwards into
    the graph whose hash is the key. Without it every process traces each layer's forward
    and backward again: ~10 of the ~35 CPU seconds a warm-cache compiled TP=2 start costs on
    2 cores. ``TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0`` turns it off.
    """
    environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", "1")
    if "TORCHINDUCTOR_CACHE_DIR" in environ:
        return
    level = environ.get("ATEN_CPU_CAPABILITY")
    if not level:
        try:
            with open(cpuinfo) as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        level = "native-" + hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        user = str(os.getuid())
    environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}", f"isa-{level}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    host_memory_defaults()
    kernel_cache_defaults()
    compile_cache_defaults()
    wanted = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(wanted).parse_args(argv)  # imports the command's module: torch, seconds
    except KeyboardInterrupt:
        print(f"megaformer{' ' + wanted if wanted else ''}: interrupted", file=sys.stderr)
        return 130
    command: Command = args._command
    logs.configure(logs.level_from(args.quiet, args.verbose))  # ranks started from here inherit the level
    try:
        matmul_setting()  # a wrong MEGAFORMER_CPU_MATMUL: one line now, not inside a rank's first step
        return int(getattr(command.load(), command.main)(args) or 0)
    except MegaformerError as err:
        print(f"megaformer {command.name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        lead = "\n" if sys.stderr.isatty() else ""  # a progress line on a terminal ends in \r, not a newline
        print(f"{lead}megaformer {command.name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as err:  # after BrokenPipeError, one of them
        if err.errno not in PATH_ERRNOS or not (err.filename or err.errno in STATE_ERRNOS):
            raise  # not a path's or the machine's state (or a path error naming no path): a bug, with its traceback
        out = getattr(args, "out", None) or getattr(args, "output", None)  # ENOSPC names no file: where it wrote
        where = err.filename if err.filename else f"writing {out}" if out else "writing"
        print(f"megaformer {command.name}: error: {path_refusal(where, err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
