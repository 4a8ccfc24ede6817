"""Translating raw text: detokenized translations out, in input order (``translate`` and ``evaluate`` use it).

Lines are encoded with the sentencepiece model stored in the checkpoint (plus the eos
every training source ends with), sorted by length and cut into batches of at most
``max_tokens`` source tokens (batch size x longest source, padding included; a longer
sentence goes alone), searched (:mod:`megaformer.decode.beam`), and written back in
input order. An empty line gives an empty line. Progress (sentences/s) goes to stderr.

``tp`` > 1 starts that many local processes (gloo on a CPU, nccl with GPUs), each holding
1/N of every layer; they search in lock step and rank 0 hands the hypotheses back.
Tokenization, checks and output stay in this process, so bad input fails before any
process starts. The commands are :mod:`megaformer.commands.translate` and
:mod:`megaformer.commands.evaluate`.
"""

from __future__ import annotations

import gzip
import json
import logging
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import sentencepiece as spm
import torch

from megaformer.checkpoint import CheckpointSource, Consolidated, locate
from megaformer.config import ParallelConfig
from megaformer.data.corpus import not_text
from megaformer.data.tokenizer import EOS_ID, PAD_ID
from megaformer.decode.beam import Hypothesis, SearchSettings, search
from megaformer.decode.loading import build_model, check_layout, load_model_file, load_tokenizer
from megaformer.errors import ConfigError, DataError, MegaformerError
from megaformer.logs import PROGRESS_ON_A_TERMINAL, STDERR, set_rank
from megaformer.logs import configure as configure_logs
from megaformer.model import Transformer
from megaformer.parallel import LOCAL, ParallelContext

LOG = logging.getLogger(__name__)

# ---- text -----------------------------------------------------------------------------------


def read_text_lines(path: str | Path | None) -> list[str]:
    """The lines of a UTF-8 file (stdin for None or "-"), without their line ends; '' stays a line.

    A path ending in ``.gz`` is read as gzip (Multi30k and WMT ship their test sets so); one
    that is truncated or not gzip is a DataError naming it, as is UTF-16, gzip under another
    name and CR-only line ends (:func:`megaformer.data.corpus.not_text`). A leading UTF-8
    byte-order mark is dropped (a reference's first word kept it, and scored lower).
    """
    stdin = path is None or str(path) == "-"
    name = Path("stdin" if stdin else path)
    try:
        if stdin:
            data = sys.stdin.buffer.read()
        else:
            data = Path(path).read_bytes()
            if Path(path).suffix == ".gz":
                data = gzip.decompress(data)
        if (problem := not_text(data.split(b"\n", 1)[0], name)) is not None:
            raise problem
        text = data.decode("utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a text file") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"{path}: not a complete gzip file ({type(err).__name__}: {err})") from None
    except UnicodeDecodeError as err:
        line = _line_of(err)
        raise DataError(f"{path or 'stdin'}: not UTF-8 text (line {line})") from None
    if not text:
        return []
    if text.endswith("\n"):  # the last line's end; a file of one empty line is one line
        text = text[:-1]
    return [line.rstrip("\r") for line in text.split("\n")]


def _line_of(err: UnicodeDecodeError) -> int:
    """1-based line number of a decoding error."""
    return err.object[: err.start].count(b"\n") + 1


def write_lines(path: str | Path | None, lines: Sequence[str]) -> None:
    """Write ``lines`` (one per line) to ``path`` (gzip where it ends in ``.gz``), or to stdout for None or "-"."""
    text = "".join(line + "\n" for line in lines)
    if path is None or str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    data = text.encode("utf-8")
    try:
        Path(path).write_bytes(gzip.compress(data, mtime=0) if Path(path).suffix == ".gz" else data)
    except OSError as err:
        raise DataError(f"{path}: cannot write ({err.strerror})") from None


def encode_lines(
    sp: spm.SentencePieceProcessor, lines: Sequence[str], max_positions: int, source: str
) -> list[list[int]]:
    """Token ids + eos of each line; [] for a blank line. A line the model cannot hold is a DataError."""
    out = []
    for number, line in enumerate(lines, start=1):
        ids = sp.encode(line) if line.strip() else []
        if ids:
            ids.append(EOS_ID)
            if len(ids) > max_positions:
                raise DataError(
                    f"{source}: line {number} has {len(ids)} tokens with eos; "
                    f"the model holds at most model.max_positions={max_positions}: split the line"
                )
        out.append(ids)
    return out


# ---- batching and search --------------------------------------------------------------------


def make_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of the non-empty sources, longest first, cut so that batch size x longest <= max_tokens."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def pad_batch(sources: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """(batch, longest) right-padded ids."""
    longest = max(len(s) for s in sources)
    out = torch.full((len(sources), longest), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(sources):
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device)


class TranslationProgress:
    """Sentences done and sentences/s on stderr, at most once a second, and a last line."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.start = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if self.enabled and now - self.last >= 1.0 and done < self.total:
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            LOG.info(
                f"translated {done}/{self.total} sentences ({rate:.1f} sentences/s)",
                extra=PROGRESS_ON_A_TERMINAL if self.tty else STDERR,
            )

    def close(self, done: int) -> float:
        seconds = time.monotonic() - self.start
        if self.enabled:
            LOG.info(
                f"translated {done} sentence{'s' * (done != 1)} in {seconds:.1f} s ({done / max(seconds, 1e-9):.1f} sentences/s)",
                extra=STDERR,
            )
        return seconds


def translate_ids(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    settings: SearchSettings,
    max_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> list[Hypothesis | None]:
    """The best hypothesis of each source (None for an empty one), in input order.

    Every rank of ``model.tp`` must call this with the same arguments.
    """
    device = next(model.parameters()).device
    out: list[Hypothesis | None] = [None] * len(sources)
    done = 0
    for batch in make_batches([len(s) for s in sources], max_tokens):
        for i, hyp in zip(batch, search(model, pad_batch([sources[i] for i in batch], device), settings)):
            out[i] = hyp
        done += len(batch)
        if progress is not None:
            progress(done)
    return out


# ---- one process or several ----------------------------------------------------------------


def _rank_main(
    ckpt: CheckpointSource,
    sources: list[list[int]],
    settings: SearchSettings,
    max_tokens: int,
    tp: int,
    result: str,
    quiet: bool,
) -> int:
    """One TP rank of :func:`run_translation` (started by ``launcher.local.spawn``): ``ckpt`` as the starting
    process located and verified it, its files not hashed again unless they changed since."""
    from launcher.env import detect  # rank, local rank (distinct GPUs) and world size the launcher set

    info = detect()
    configure_logs()  # at the level the starting process chose (its environment)
    set_rank(info.rank)
    ctx = ParallelContext.initialize(ParallelConfig(tp=tp), info.rank, info.world_size, info.local_rank)
    try:
        model = build_model(load_model_file(ckpt), ctx.tp, ctx.device, source=str(ckpt))
        progress = TranslationProgress(sum(1 for s in sources if s), enabled=ctx.is_main and not quiet)
        hyps = translate_ids(model, sources, settings, max_tokens, progress)
        seconds = progress.close(sum(1 for s in sources if s))
        if ctx.is_main:
            rows = [None if h is None else [h.tokens, h.score, h.logprob] for h in hyps]
            Path(result).write_text(json.dumps({"hypotheses": rows, "seconds": seconds}))
    finally:
        ctx.destroy()
    return 0


def run_translation(
    ckpt: str | Path | CheckpointSource,
    model: Consolidated,
    sources: list[list[int]],
    settings: SearchSettings,
    max_tokens: int,
    tp: int = 1,
    quiet: bool = False,
) -> tuple[list[Hypothesis | None], float]:
    """Translate ``sources`` (ids + eos) with ``model`` at ``tp`` ranks; (hypotheses, seconds searching).

    tp = 1 searches in this process (on a GPU if there is one); tp > 1 starts tp local
    processes that read the model from ``ckpt`` (a located source is handed to them as it is,
    so that they hash nothing it verified) and return rank 0's result through a file.
    """
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {tp}")
    check_layout(model, tp, source=str(ckpt))
    if tp == 1:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        net = build_model(model, LOCAL, device, source=str(ckpt))
        progress = TranslationProgress(sum(1 for s in sources if s), enabled=not quiet)
        hyps = translate_ids(net, sources, settings, max_tokens, progress)
        return hyps, progress.close(sum(1 for s in sources if s))

    from launcher.local import spawn  # the launcher is imported only when processes are started

    if not isinstance(ckpt, CheckpointSource):
        ckpt = locate(ckpt, log=_to_stderr)
    with tempfile.TemporaryDirectory(prefix="megaformer-translate-") as tmp:
        result = Path(tmp) / "result.json"
        code = spawn(_rank_main, tp, ckpt, sources, settings, max_tokens, tp, str(result), quiet)
        if code == 130:  # Ctrl-C reached every rank, which stopped: the command was interrupted, nothing failed
            raise KeyboardInterrupt
        if code != 0 or not result.is_file():
            raise MegaformerError(f"{tp} decoding processes failed (exit status {code}); their messages are above")
        data = json.loads(result.read_text())
    hyps = [None if r is None else Hypothesis(r[0], r[1], r[2]) for r in data["hypotheses"]]
    return hyps, data["seconds"]


def translate_text(
    ckpt: str | Path | CheckpointSource,
    model: Consolidated,
    lines: Sequence[str],
    settings: SearchSettings,
    *,
    max_tokens: int = 4096,
    tp: int = 1,
    quiet: bool = False,
    source: str = "input",
) -> tuple[list[str], float]:
    """Detokenized translations of raw ``lines`` ('' for blank lines) and the seconds spent searching.

    ``model`` is what ``ckpt`` holds, already read (:func:`open_model`); ``source``
    names the input in error messages.
    """
    if max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {max_tokens}")
    if 2 * settings.beam > model.vocab_size - 2:
        raise ConfigError(f"--beam {settings.beam} is too large for a vocabulary of {model.vocab_size}")
    sp = load_tokenizer(model, source=str(ckpt))
    sources = encode_lines(sp, lines, model.config.model.max_positions, source)
    hyps, seconds = run_translation(ckpt, model, sources, settings, max_tokens, tp, quiet)
    return ["" if h is None else sp.decode(h.tokens) for h in hyps], seconds


def open_model(path: str | Path, command: str) -> tuple[Consolidated, CheckpointSource]:
    """The model at ``path`` and the source it was read from, located and verified once
    (:func:`megaformer.checkpoint.locate`), to hand to :func:`translate_text`.

    The source is a path too: the file as named, or the step directory a run directory
    resolves to. When the newest checkpoint of a run directory is damaged and an older one
    is used, each skipped checkpoint and the one chosen are announced on stderr.
    """
    source = locate(path, log=lambda message: LOG.warning(f"megaformer {command}: {message}"))  # said under -q too
    return load_model_file(source), source


def _to_stderr(message: str) -> None:
    """A checkpoint skipped, or an older one used: said under -q too."""
    LOG.warning(message)
