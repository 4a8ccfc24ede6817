"""Writing one consolidated model as an export: the formats, what an output's name says, what an export made.

:func:`write_export` writes through a staged temporary path (renamed into place at the
end); :func:`output_kind` says which format and shape (file or directory) an output name
takes and refuses a name of another format; :func:`made_by_export` tells an earlier
export (what ``megaformer export --force`` may replace) from anything else.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from megaformer.export import ExportError

if TYPE_CHECKING:
    from megaformer.checkpoint import Consolidated

FORMATS = ("safetensors", "hf", "ct2", "pt")
MODEL_SUFFIXES = (".safetensors", ".pt", ".bin")  # names of one-file models, never of a directory
# Names that say one file of another kind: a directory export named so (`--out model.txt`) is a typo, not a wish.
FILE_SUFFIXES = (".pth", ".ckpt", ".onnx", ".h5", ".pkl", ".npz", ".json", ".yaml", ".yml", ".txt", ".gz", ".zip")
FILE_SUFFIXES += (".tar", ".tgz", ".log")


def output_kind(out: Path, fmt: str | None) -> tuple[str, bool]:
    """(format, whether the output is a directory) for ``--out`` and ``--format``; refuses a name of another format."""
    if fmt is None:
        fmt = "pt" if out.suffix == ".pt" else "safetensors"
    if fmt == "pt":
        if out.suffix != ".pt":
            raise ExportError(f"--out {out}: --format pt writes one megaformer model file: name it NAME.pt")
        return fmt, False
    if fmt == "safetensors":
        if out.suffix in (".pt", ".bin", ".pth", ".ckpt"):
            raise ExportError(
                f"--out {out}: --format safetensors writes NAME.safetensors or a directory, not a {out.suffix} "
                f"file: rename it, or use --format pt for NAME.pt"
            )
        if out.suffix.lower() in FILE_SUFFIXES:
            raise ExportError(
                f"--out {out}: a safetensors export is one NAME.safetensors file or a directory, and a "
                f"{out.suffix} name says another kind of file: rename it"
            )
        return fmt, out.suffix != ".safetensors"
    if out.suffix in MODEL_SUFFIXES or out.suffix.lower() in FILE_SUFFIXES:
        raise ExportError(f"--out {out}: --format {fmt} writes a directory; give a directory name")
    return fmt, True


def made_by_export(path: Path) -> bool:
    """An earlier output of ``export`` (what ``--force`` may replace): an export directory, or a model file of ours."""
    from megaformer.checkpoint import CONSOLIDATED_FORMAT
    from megaformer.export.safetensors_format import FORMAT, MANIFEST

    if path.is_dir():
        return (path / MANIFEST).is_file()
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:  # reads the header only
                return (f.metadata() or {}).get("format") == FORMAT
        if path.suffix == ".pt":  # a consolidated model names its format in its pickle (tensors lie apart)
            with zipfile.ZipFile(path) as archive:
                pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
                return bool(pickles) and CONSOLIDATED_FORMAT.encode() in archive.read(pickles[0])
    except Exception:  # not a file of ours, whatever its library says
        return False
    return False


def foreign_to_export(path: Path) -> list[str]:
    """The names in an earlier export directory that its manifest does not list (what ``--force`` must not
    delete): all of them if the manifest cannot be read; none for a model file."""
    from megaformer.export.safetensors_format import MANIFEST

    if not path.is_dir():
        return []
    try:
        listed = set(json.loads((path / MANIFEST).read_text())["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        listed = {MANIFEST}
    return sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir() if p.name not in listed)


def write_export(model: Consolidated, out: Path, fmt: str, *, force: bool = False) -> None:
    """Write consolidated ``model`` to ``out`` in ``fmt`` through a staged temporary path."""
    from megaformer.export.safetensors_format import save_safetensors_file, staged_output, write_safetensors_dir

    _, directory = output_kind(out, fmt)
    if fmt in ("hf", "ct2"):  # refuse before anything is written
        from megaformer.export.hf import check_tokenizer
        from megaformer.export.marian import check_marian

        check_marian(model, final_norms=fmt == "ct2")
        check_tokenizer(model)
    with staged_output(out, force, directory=directory) as tmp:
        if fmt == "pt":
            from megaformer.checkpoint import save_consolidated

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
