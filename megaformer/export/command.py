"""``megaformer export``: one TP-independent model in a format other tools load.

    megaformer export --ckpt RUN_OR_STEP_OR_MODEL --out PATH [--format safetensors|hf|ct2|pt] [--force]

* ``safetensors`` (default): ``PATH.safetensors`` is one self-contained file; any other
  PATH is a directory (weights, config, tokenizer, manifest);
* ``hf``: a directory that ``MarianMTModel.from_pretrained`` and ``MarianTokenizer.from_pretrained`` load;
* ``ct2``: a CTranslate2 model directory;
* ``pt``: megaformer's consolidated torch file (what ``average`` writes); chosen by default
  when PATH ends in ``.pt``.

``--ckpt`` takes a run directory (its newest complete checkpoint, announced when an older
one is used), a step directory of any TP size, or a model file or export. The output is
written beside PATH under a temporary name and renamed at the end; an existing PATH is
replaced only with ``--force``, and never when it is (or holds) the input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaformer.cli_args import existing_path
from megaformer.export import ExportError

FORMATS = ("safetensors", "hf", "ct2", "pt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt",
        type=existing_path,
        required=True,
        help="run directory, checkpoint step directory, model file or export",
    )
    p.add_argument("--out", required=True, help="file (NAME.safetensors, NAME.pt) or directory to write")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="safetensors (default; pt when --out ends in .pt), hf (Hugging Face MarianMT), ct2 (CTranslate2), pt",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out")


def output_kind(out: Path, fmt: str | None) -> tuple[str, bool]:
    """(format, whether the output is a directory) for ``--out`` and ``--format``."""
    if fmt is None:
        fmt = "pt" if out.suffix == ".pt" else "safetensors"
    if fmt == "pt":
        return fmt, False
    if fmt == "safetensors":
        return fmt, out.suffix != ".safetensors"
    if out.suffix in (".safetensors", ".pt", ".bin"):
        raise ExportError(f"--out {out}: --format {fmt} writes a directory; give a directory name")
    return fmt, True


def check_not_input(out: Path, ckpt: Path) -> None:
    """Refuse an output that is the input or holds it: replacing it would destroy the input."""
    o, c = out.resolve(), ckpt.resolve()
    if o == c or o in c.parents:
        raise ExportError(f"--out {out} is (or holds) the input {ckpt}: write the export elsewhere")


def main(args: argparse.Namespace) -> int:
    from megaformer.decode.loading import load_model_file

    out, ckpt = Path(args.out), Path(args.ckpt)
    fmt, directory = output_kind(out, args.format)
    check_not_input(out, ckpt)
    if out.exists() and not args.force:  # before reading a large checkpoint
        raise ExportError(f"{out}: already exists; choose another --out or pass --force to replace it")
    model = load_model_file(ckpt, log=lambda m: print(m, file=sys.stderr))
    if fmt in ("hf", "ct2"):  # a command prints its own one-line result, not transformers' progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    write_export(model, out, fmt, force=args.force)
    n = sum(t.numel() for t in model.model.values())
    print(
        f"export: wrote {out} ({fmt}, {n:,} values, step {model.meta.get('step')}) from {model.meta.get('source', ckpt)}"
    )
    return 0


def write_export(model, out: Path, fmt: str, *, force: bool = False) -> None:
    """Write consolidated ``model`` to ``out`` in ``fmt`` through a staged temporary path."""
    from megaformer.export.safetensors_format import save_safetensors_file, staged_output, write_safetensors_dir

    _, directory = output_kind(out, fmt)
    if fmt in ("hf", "ct2"):  # refuse before anything is written
        from megaformer.export.hf import check_tokenizer
        from megaformer.export.marian import check_marian

        check_marian(model)
        check_tokenizer(model)
    with staged_output(out, force, directory=directory) as tmp:
        if fmt == "pt":
            from megaformer.train.checkpoint import save_consolidated

            save_consolidated(tmp, model)
        elif fmt == "safetensors" and directory:
            write_safetensors_dir(tmp, model)
        elif fmt == "safetensors":
            save_safetensors_file(tmp, model)
        elif fmt == "hf":
            from megaformer.export.hf import write_hf_dir

            write_hf_dir(tmp, model)
        else:
            from megaformer.export.ct2 import write_ct2_dir

            write_ct2_dir(tmp, model)
