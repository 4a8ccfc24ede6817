"""What the Trainer adds on the host: its step time and dispatched operators against a plain PyTorch loop.

    python benchmarks/host_overhead.py [--steps 20] [--warmup 3] [--device cpu|cuda] [--json]

A model of the big preset's depth at a tiny width (d_model 64, 4 heads, d_ff 256, 6 + 6
layers, dropout 0.1) trains on the built-in corpus with 2 micro-batches per optimizer
step, so that the kernels are cheap and what is left is host work: Python, dispatch,
DeepSpeed's hooks, the feed, the control all-reduces.

1. **megaformer**: ``Trainer.step`` (one process, gloo, fp32, ZeRO-0), timed per
   optimizer step after ``--warmup`` steps; the median of ``--steps``.
2. **reference**: the same micro-batches through a plain loop: ``torch.nn.Transformer``
   with the paper's dropout placement (``F.dropout`` on the embeddings and sub-layer
   outputs only, as megaformer drops), a shared embedding tied to the output projection,
   ``F.cross_entropy(label_smoothing=0.1)``, fused AdamW; the median step.
3. **operators**: aten operators dispatched by one micro-batch's forward and backward in
   each (counted with a ``TorchDispatchMode``).
4. **device reads**: the values the host reads back from tensors in one more steady step
   of the Trainer (``item``, ``float``, ``bool``, ``tolist``). On a GPU each one waits for
   every kernel queued before it, so the GPU runs dry until the host queues the next; the
   Trainer reads once (its all-reduce of the step's flags, tokens and loss); DeepSpeed's
   optimizers add their own (none in this fp32 ZeRO-0 run; see docs/design.md). A copy
   between devices that is not ``non_blocking`` and an operator whose output size depends
   on the data count too. ``--device cuda`` (nccl) also counts the synchronisations
   ``torch.cuda.set_sync_debug_mode("warn")`` reports in that step (copies to the device
   from unpinned memory included), and times each step to the end of its kernels.

``host_time_ratio`` (megaformer / reference, target <= 1.5) and ``ops_ratio`` (target
<= 1.3) are measured in the same run, alternating A B A B so that drift hits both.
On a CPU the step's wall time is host time: nothing runs asynchronously.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaformer import cli  # noqa: E402
from megaformer.cli_args import nonneg_int, positive_int  # noqa: E402
from megaformer.config import load_config  # noqa: E402
from megaformer.model import sinusoidal_positions  # noqa: E402
from megaformer.parallel import ParallelContext  # noqa: E402
from megaformer.train.trainer import StepFlags  # noqa: E402

D_MODEL, HEADS, D_FF, LAYERS, DROPOUT, SMOOTHING = 64, 4, 256, 6, 0.1, 0.1
MICRO_TOKENS = 1024


class Reference(nn.Module):
    """``nn.Transformer`` with a shared, scaled embedding, the paper's dropout placement, a tied output layer."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D_MODEL, padding_idx=0)
        nn.init.normal_(self.embed.weight, 0.0, D_MODEL**-0.5)
        self.register_buffer("positions", sinusoidal_positions(1024, D_MODEL), persistent=False)
        self.transformer = nn.Transformer(D_MODEL, HEADS, LAYERS, LAYERS, D_FF, DROPOUT, batch_first=True)
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.dropout = nn.Identity()  # megaformer drops no feed-forward activations ...
            layer.self_attn.dropout = 0.0  # ... nor attention probabilities (the paper's placement)
            if hasattr(layer, "multihead_attn"):
                layer.multihead_attn.dropout = 0.0

    def loss(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        def embed(ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids) * math.sqrt(D_MODEL) + self.positions[: ids.shape[1]]
            return F.dropout(x, DROPOUT, self.training)

        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)  # True: may not attend (boolean, like the padding masks)
        hidden = self.transformer(
            embed(src),
            embed(tgt_in),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src.eq(0),
            tgt_key_padding_mask=tgt_in.eq(0),
            memory_key_padding_mask=src.eq(0),
        )
        logits = F.linear(hidden, self.embed.weight)  # (batch, tgt_len, vocab)
        return F.cross_entropy(
            logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0, label_smoothing=SMOOTHING, reduction="sum"
        )


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


_READS = {  # operators that make the host wait for the device: a value read back, an output sized by the data
    torch.ops.aten._local_scalar_dense.default,  # item, float, int, bool, a tensor in an `if`
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.equal.default,
    torch.ops.aten._unique2.default,
}


class DeviceReads(TorchDispatchMode):
    """Counts what makes the host wait for the device while it is active (:data:`_READS`, and a copy between devices
    that is not ``non_blocking``). ``tolist`` reads a CPU tensor without dispatching: it is counted where it is called
    (in every thread: the mode itself is this thread's)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            self.count += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and not kwargs.get(
            "non_blocking",
            len(args) > 2 and args[2],  # copy_(self, src, non_blocking)
        ):
            devices = {a.device for a in args if isinstance(a, torch.Tensor)} | {kwargs.get("device") or args[0].device}
            self.count += len(devices) > 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(tensor: torch.Tensor):
            self.count += 1
            return self._tolist(tensor)

        torch.Tensor.tolist = tolist
        try:
            return super().__enter__()
        except BaseException:
            torch.Tensor.tolist = self._tolist
            raise

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def cuda_syncs(step, device: torch.device) -> int | None:
    """The synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports while ``step()`` runs; None off CUDA."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def ops_of(loss_fn) -> int:
    """aten operators of one forward and backward."""
    with OpCounter() as counter:
        loss_fn().backward()
    return counter.count


def build_trainer(data: Path, run_dir: Path, extra: tuple[str, ...] = ()):
    from megaformer.train.trainer import Trainer

    sets = [
        f"data.path={data}", f"model.d_model={D_MODEL}", f"model.num_heads={HEADS}", f"model.d_ff={D_FF}",
        f"model.encoder_layers={LAYERS}", f"model.decoder_layers={LAYERS}", f"model.dropout={DROPOUT}",
        f"data.max_tokens={MICRO_TOKENS}", f"train.tokens_per_step={2 * MICRO_TOKENS}", "data.num_workers=0",
        "train.eval_interval=0", "train.save_interval=0", "train.log_interval=1000000", "train.max_steps=100000",
        f"train.label_smoothing={SMOOTHING}", "parallel.backend=gloo",
    ]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "tiny.yaml", sets + list(extra))
    ctx = ParallelContext.initialize(cfg.parallel, 0, 1, single_process_group=True)
    trainer = Trainer(cfg, ctx, run_dir, resume="none")
    trainer.engine.train()
    return trainer, ctx


def measure(steps: int, warmup: int, log, device: str = "cpu") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        if cli.main(["prepare", "--synthetic", "4000", "--out", str(data), "--quiet"]) != 0:
            raise SystemExit("host_overhead: prepare failed")
        backend = ("parallel.backend=nccl",) if device == "cuda" else ()
        trainer, ctx = build_trainer(data, Path(tmp) / "run", backend)
        try:
            return _compare(trainer, steps, warmup, log)
        finally:
            ctx.destroy()


def _compare(trainer, steps: int, warmup: int, log) -> dict:
    torch.manual_seed(0)
    device = trainer.ctx.device
    done = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ref = Reference(trainer.cfg.data.vocab_size).to(device)
    optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    flags = StepFlags()  # no signal, no time limit, no save due, no cool-down
    times: dict[str, list[float]] = {"megaformer": [], "reference": []}
    taken = []  # the micro-batches of each step the trainer takes from its feed: the reference trains on them too
    next_step = trainer.feed.next_step
    trainer.feed.next_step = lambda: taken.append(next_step()) or taken[-1]
    for i in range(warmup + steps):
        began = time.perf_counter()
        trainer.step(flags)
        done()
        mega = time.perf_counter() - began
        micro = [m.batch.to(device) for m in taken.pop()]
        done()
        began = time.perf_counter()
        for b in micro:
            (ref.loss(b.src, b.tgt_in, b.tgt_out) / 2048).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done()
        reference = time.perf_counter() - began
        if i >= warmup:
            times["megaformer"].append(mega)
            times["reference"].append(reference)
        log(f"step {i + 1}/{warmup + steps}: megaformer {mega * 1e3:.1f} ms, reference {reference * 1e3:.1f} ms")
    with DeviceReads() as reads:
        trainer.step(flags)
    syncs = cuda_syncs(lambda: trainer.step(flags), device)
    b = micro[0]
    model, smoothing = trainer.model, trainer.cfg.train.label_smoothing
    ops = {
        "megaformer": ops_of(lambda: model.loss(b.src, b.tgt_in, b.tgt_out, smoothing)[0]),
        "reference": ops_of(lambda: ref.loss(b.src, b.tgt_in, b.tgt_out)),
    }
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "host_time_ratio": round(medians["megaformer"] / medians["reference"], 3),
        "ops_ratio": round(ops["megaformer"] / ops["reference"], 3),
        "megaformer_step_ms": round(medians["megaformer"] * 1e3, 2),
        "reference_step_ms": round(medians["reference"] * 1e3, 2),
        "megaformer_ops_per_micro_batch": ops["megaformer"],
        "reference_ops_per_micro_batch": ops["reference"],
        "megaformer_device_reads_per_step": reads.count,
        "megaformer_cuda_syncs_per_step": syncs,  # None off CUDA
        "device": str(device),
        "micro_batches_per_step": len(micro),
        "steps": steps,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="host_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=20, help="timed optimizer steps (default: %(default)s)")
    parser.add_argument("--warmup", type=nonneg_int, default=3, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both train (cuda: nccl)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    # with --json, stdout is the one object: what the trainer prints goes to stderr with the progress
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("host_overhead: --device cuda: no CUDA GPU is visible")
        r = measure(args.steps, args.warmup, log, args.device)
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"host time per step: megaformer {r['megaformer_step_ms']} ms, reference {r['reference_step_ms']} ms: "
            f"{r['host_time_ratio']}x (target <= 1.5)"
        )
        print(
            f"aten ops per micro-batch: megaformer {r['megaformer_ops_per_micro_batch']}, reference "
            f"{r['reference_ops_per_micro_batch']}: {r['ops_ratio']}x (target <= 1.3)"
        )
        syncs = r["megaformer_cuda_syncs_per_step"]
        print(
            f"device reads in a steady step: megaformer {r['megaformer_device_reads_per_step']} (target <= 1)"
            + (f"; CUDA synchronisations {syncs}" if syncs is not None else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
