"""What a training rank builds before its first step: the data adopted, the checkpoint to resume, the model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megaformer import checkpoint as ckpt
from megaformer.config import Config
from megaformer.data.manifest import manifest_path, read_manifest
from megaformer.data.stream import open_prepared
from megaformer.errors import ConfigError
from megaformer.model import Transformer
from megaformer.parallel import DropoutRNG, ParallelContext
from megaformer.parallel.stages import StagePart
from megaformer.train.budget import compile_choice
from megaformer.train.device import cpu_bf16_missing, require_cpp_compiler
from megaformer.train.unused import settings_without_effect

Log = Callable[[str], None]


def adopt_data(cfg: Config, log: Log) -> tuple[dict, Path, bool]:
    """The prepared data's manifest, its tokenizer and whether it has a valid split; its vocabulary and
    direction become the run's (``cfg.data``)."""
    if not cfg.data.path:
        raise ConfigError("data.path is empty: set it to a directory written by `megaformer prepare`")
    manifest = read_manifest(manifest_path(cfg.data.path))
    if idle := settings_without_effect(cfg, int(manifest["tokenizer"]["vocab_size"])):
        log(f"train: without effect in this run: {'; '.join(idle)}")
    cfg.data.vocab_size = int(manifest["tokenizer"]["vocab_size"])  # the data's, as its direction:
    cfg.data.src_lang, cfg.data.tgt_lang = manifest["src_lang"], manifest["tgt_lang"]
    return manifest, open_prepared(cfg.data.path, "train").tokenizer_path, "valid" in manifest["splits"]


def resume_point(resume: str, run_dir: Path, log: Log) -> Path | None:
    """The step directory ``--resume`` names (``auto``: the run directory's newest complete one; ``none``: None)."""
    if resume != "auto":
        return None if resume == "none" else ckpt.resolve_checkpoint(resume, log=log)
    found = ckpt.find_latest(run_dir, log=log)
    if found is None:
        log(f"train: no checkpoint under {run_dir}, starting from scratch")
    return found


def build_model(cfg: Config, ctx: ParallelContext, rng: DropoutRNG, part: StagePart, log: Log) -> Transformer:
    """This rank's part of the model (its pipeline stage, its TP shard) on the run's device, compiled if asked."""
    t = cfg.train
    model = Transformer.of_run(cfg, ctx.tp, rng, part).to(ctx.device)
    native_bf16 = ctx.device.type != "cpu" or cpu_bf16_missing() is None
    compiled, why = compile_choice(t.compile, ctx.device, t.precision, t.max_minutes, native_bf16)
    if compiled:
        if ctx.device.type == "cpu":
            require_cpp_compiler()
        model.compile_layers()
    log(
        f"train: {why}"
        + ("; the encoder and decoder layers run compiled (the first steps compile them)" if compiled else "")
    )
    return model
