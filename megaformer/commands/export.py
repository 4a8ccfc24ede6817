"""``megaformer export``: one TP-independent model in a format other tools load.

    megaformer export --ckpt RUN_OR_STEP_OR_MODEL --out PATH [--format safetensors|hf|ct2|pt] [--force]

* ``safetensors`` (default): ``PATH.safetensors`` is one self-contained file; any other
  PATH is a directory (weights, config, tokenizer, manifest), unless its name says another
  kind of file (``model.txt``, ``model.pth``: refused as a typo);
* ``hf``: a directory that ``MarianMTModel.from_pretrained`` and ``MarianTokenizer.from_pretrained`` load;
* ``ct2``: a CTranslate2 model directory;
* ``pt``: megaformer's consolidated torch file (what ``average`` writes); chosen by default
  when PATH ends in ``.pt``.

``--ckpt`` takes a run directory (its newest complete checkpoint, announced when an older
one is used), a step directory of any TP size, or a model file or export. The output is
written beside PATH under a temporary name and renamed at the end
(:func:`megaformer.export.write.write_export`). Nothing read is ever written: PATH may
not be, hold or lie inside the input (its step directory included). A PATH whose name
says another format (``--format pt --out x.safetensors``) is refused. An existing PATH is
replaced only with ``--force`` and only when an earlier export made it (an export
directory, a megaformer ``.safetensors`` or ``.pt`` file) or it is an empty folder; never
the working directory or a folder above it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaformer.checkpoint.format import check_step_name
from megaformer.cli_args import (
    existing_path,
    new_path,
    overlap,
    refuse_checkpoint_names,
    refuse_output_over_inputs,
    refuse_to_replace,
)
from megaformer.export.write import FORMATS, foreign_to_export, made_by_export, output_kind, write_export


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt",
        type=existing_path,
        required=True,
        help="run directory, checkpoint step directory, model file or export",
    )
    p.add_argument("--out", type=new_path, required=True, help="file (NAME.safetensors, NAME.pt) or directory to write")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="safetensors (default; pt when --out ends in .pt), hf (Hugging Face MarianMT), ct2 (CTranslate2), pt",
    )
    p.add_argument("--force", action="store_true", help="replace an earlier export at --out")


def _is_run_dir(path: Path) -> bool:
    from megaformer.checkpoint import STEP_DIR

    return path.is_dir() and not STEP_DIR.match(path.name) and not (path / "megaformer-export.json").is_file()


def check_not_input(out: Path, ckpt: Path, read: Path | None = None) -> None:
    """Refuse an output that is, holds or lies inside what is read: ``ckpt`` and the step directory it resolves to.

    Beside the checkpoints of a run directory is fine (``--ckpt RUN --out RUN/model.safetensors``);
    inside a step directory or an export it is not.
    """
    inputs = [("input", read)] if read is not None and read != ckpt else []
    if not (_is_run_dir(ckpt) and overlap(out, ckpt) == "is inside"):
        inputs.append(("input", ckpt))
    refuse_output_over_inputs("--out", out, inputs, "export")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    from megaformer.checkpoint import locate
    from megaformer.decode.loading import load_model_file

    out, ckpt = Path(args.out), Path(args.ckpt)
    fmt, _ = output_kind(out, args.format)
    check_not_input(out, ckpt)
    refuse_checkpoint_names("--out", out)
    refuse_to_replace(
        "--out", out, args.force, made_by_export, "no megaformer-export.json, no megaformer model", foreign_to_export
    )
    source = locate(ckpt, _stderr)  # verified once; an older checkpoint used is announced
    read = source.path
    check_not_input(out, ckpt, read)
    model = load_model_file(source)
    check_step_name(out, model.meta.get("step"))  # not a step-N name that says another step
    if fmt in ("hf", "ct2"):  # a command prints its own one-line result, not transformers' progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    write_export(model, out, fmt, force=args.force)
    n = sum(t.numel() for t in model.model.values())
    steps = model.meta.get("averaged_steps")  # an average names its steps, not only the newest one's
    what = f"the average of steps {steps}" if steps else f"step {model.meta.get('step')}"
    print(f"export: wrote {out} ({fmt}, {n:,} values, {what}) from {read}")
    return 0
