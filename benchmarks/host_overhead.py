"""What the Trainer adds on the host: its step time and dispatched operators against a plain PyTorch loop.

    python benchmarks/host_overhead.py [--steps 20] [--warmup 3] [--device cpu|cuda] [--precision bf16|fp32]
        [--zero 0|1|2] [--optimizer auto|deepspeed|lean] [--clip-grad X] [--shape tiny|big] [--json]

A model of the big preset's depth (6 + 6 layers) trains on the built-in corpus with 2
micro-batches of 1,024 tokens per optimizer step, in the GPU runs' configuration by default:
bf16 (bf16 weights, fp32 copies for the optimizer, gradients summed in fp32), ZeRO-1, the
paper's lr schedule, a finite check of the loss and the gradient norm each step.
``--shape tiny`` (the default: d_model 64, 4 heads, d_ff 256, dropout 0.1) keeps the kernels
cheap, so that what is left is host work: Python, dispatch, the engine's hooks, the feed, the
control all-reduces; ``--shape big`` has transformer_big's layers (d_model 1024, 16 heads,
d_ff 4096, dropout 0.3), for a GPU (gpu.sh's check d). On a CPU keep to tiny: bf16 there is
slow without AVX512-BF16 or AMX (it is emulated on AVX2-only machines).

1. **megaformer**: ``Trainer.step`` (one process; gloo on a CPU, nccl on a GPU) with the engine
   ``megaformer/train/engine.py``'s ``build_engine`` picks (``train.optimizer``, ``--optimizer``:
   by default the lean engine on one GPU, DeepSpeed's ZeRO-``--zero`` on a CPU), timed per
   optimizer step after ``--warmup`` steps; the median of ``--steps``.
2. **reference**: the same micro-batches through a plain loop doing the same work:
   ``torch.nn.Transformer`` with the paper's dropout placement (``F.dropout`` on the
   embeddings and sub-layer outputs only, as megaformer drops), a shared embedding tied to the
   output projection, ``F.cross_entropy(label_smoothing=0.1)`` on fp32 logits, each
   micro-batch's summed loss over the step's target tokens; in bf16 the model's weights bf16,
   their gradients added into fp32 sums after each micro-batch; the gradient norm (clipped to
   ``--clip-grad`` when it is > 0), torch's fused Adam (lr 1.0 scaled by the Trainer's
   ``InverseSqrtSchedule``) on the fp32 weights, copied back to the model; whether the loss or
   the norm is not finite, read with the loss once a step (the Trainer's one read); the
   median step.
3. **operators**: aten operators dispatched by one micro-batch's forward and backward in
   each (counted with a ``TorchDispatchMode``).
4. **device reads**: the values the host reads back from tensors in one more steady step
   of each (``item``, ``float``, ``bool``, ``tolist``). On a GPU each one waits for every
   kernel queued before it, so the GPU runs dry until the host queues the next; the Trainer
   reads once (its all-reduce of the step's flags, tokens and loss); DeepSpeed's optimizers
   add their own (:func:`reads_target`, from docs/design.md). A copy between devices that is
   not ``non_blocking`` and an operator whose output size depends on the data count too.
   ``--device cuda`` (nccl) also counts the synchronisations
   ``torch.cuda.set_sync_debug_mode("warn")`` reports in that step (copies to the device from
   unpinned memory included), and times each step to the end of its kernels.

Every tensor, generator and optimizer state of the reference is made on the run's device.
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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaformer import cli  # noqa: E402
from megaformer.cli_args import finite_float, int_range, nonneg_int, positive_int  # noqa: E402
from megaformer.config import TrainConfig, load_config  # noqa: E402
from megaformer.data.stream import Batch  # noqa: E402
from megaformer.model import sinusoidal_positions  # noqa: E402
from megaformer.parallel import ParallelContext  # noqa: E402
from megaformer.train.schedule import InverseSqrtSchedule  # noqa: E402
from megaformer.train.trainer import StepFlags  # noqa: E402

LAYERS, SMOOTHING = 6, 0.1
MICRO_TOKENS = 1024


@dataclass(frozen=True)
class Shape:
    """The width of both models (the depth is the big preset's, ``LAYERS`` + ``LAYERS``)."""

    d_model: int
    heads: int
    d_ff: int
    dropout: float

    def sets(self) -> list[str]:
        """The Trainer's config overrides for this shape."""
        return [
            f"model.d_model={self.d_model}", f"model.num_heads={self.heads}", f"model.d_ff={self.d_ff}",
            f"model.encoder_layers={LAYERS}", f"model.decoder_layers={LAYERS}", f"model.dropout={self.dropout}",
        ]  # fmt: skip


SHAPES = {
    "tiny": Shape(64, 4, 256, 0.1),  # cheap kernels: the step's time is the host's
    "big": Shape(1024, 16, 4096, 0.3),  # configs/transformer_big.yaml's layers
}
TINY = SHAPES["tiny"]


def reads_target(engine: str, precision: str, zero_stage: int, clip_grad: float) -> int:
    """The reads of the device a steady Trainer step should make: its own one, and DeepSpeed's optimizer's
    (docs/design.md): one in bf16 ZeRO-0/1 and fp32 ZeRO-1/2 (its check of the gradient norm), two in fp16 and
    bf16 ZeRO-2 (an overflow check too), none in fp32 ZeRO-0; one more with ``train.clip_grad``. The lean engine
    (``engine`` not DeepSpeed's) reads nothing back."""
    if not engine.startswith("deepspeed"):
        return 1
    if precision == "fp16" or (precision == "bf16" and zero_stage == 2):
        deepspeed = 2
    else:
        deepspeed = 0 if precision == "fp32" and zero_stage == 0 else 1
    return 1 + deepspeed + (clip_grad > 0)


def engine_of(trainer) -> str:
    """The Trainer's optimizer path as its log line says it (``deepspeed zero=1``, ``lean optimizer``)."""
    describe = getattr(trainer.engine, "describe", None)
    return describe() if callable(describe) else f"deepspeed zero={trainer.cfg.train.zero_stage}"


class Reference(nn.Module):
    """``nn.Transformer`` with a shared, scaled embedding, the paper's dropout placement, a tied output layer."""

    def __init__(self, vocab: int, shape: Shape = TINY) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(vocab, shape.d_model, padding_idx=0)
        nn.init.normal_(self.embed.weight, 0.0, shape.d_model**-0.5)
        self.register_buffer("positions", sinusoidal_positions(1024, shape.d_model), persistent=False)
        self.transformer = nn.Transformer(
            shape.d_model, shape.heads, LAYERS, LAYERS, shape.d_ff, shape.dropout, batch_first=True
        )
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.dropout = nn.Identity()  # megaformer drops no feed-forward activations ...
            layer.self_attn.dropout = 0.0  # ... nor attention probabilities (the paper's placement)
            if hasattr(layer, "multihead_attn"):
                layer.multihead_attn.dropout = 0.0

    def loss(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        d = self.shape.d_model

        def embed(ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids) * math.sqrt(d) + self.positions[: ids.shape[1]]
            return F.dropout(x, self.shape.dropout, self.training)

        t = tgt_in.shape[1]
        # True: may not attend (boolean, like the padding masks); on the batch's device
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt_in.device).triu(1)
        hidden = self.transformer(
            embed(src),
            embed(tgt_in),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src.eq(0),
            tgt_key_padding_mask=tgt_in.eq(0),
            memory_key_padding_mask=src.eq(0),
        )
        logits = F.linear(hidden, self.embed.weight)  # (batch, tgt_len, vocab), in the weights' dtype
        return F.cross_entropy(
            logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=0, label_smoothing=SMOOTHING, reduction="sum"
        )


class PlainLoop:
    """The reference's optimizer step, written out: what the Trainer's engine does, without DeepSpeed.

    bf16: the model's weights in bf16, fp32 copies for Adam, each micro-batch's gradients added
    into fp32 sums (DeepSpeed's bf16 optimizer with ``grad_accum_dtype`` fp32); fp32: the weights
    themselves. Then the gradient norm (and clipping by it when ``clip_grad`` > 0), fused Adam at
    the paper's lr schedule, the weights copied back, and one read of the loss and the finite check.
    """

    def __init__(self, model: Reference, t: TrainConfig, precision: str, device: torch.device) -> None:
        self.model, self.device, self.clip = model, device, t.clip_grad
        self.weights = list(model.parameters())
        self.bf16 = precision == "bf16"
        # the optimizer's fp32 weights (on the device, as the model is)
        self.master = [w.detach().clone() for w in self.weights] if self.bf16 else self.weights
        if self.bf16:
            for m in self.master:
                m.grad = torch.zeros_like(m)
            model.to(torch.bfloat16)
        self.optimizer = torch.optim.Adam(
            self.master, lr=1.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
            fused=True,
        )  # fmt: skip
        schedule = InverseSqrtSchedule(model.shape.d_model, t.warmup_steps, t.lr_scale)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def step(self, micro: list[Batch]) -> float:
        """One optimizer step over ``micro`` (on the device); the step's summed loss."""
        tokens = float(sum(b.tgt_tokens for b in micro))
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for b in micro:
            loss = self.model.loss(b.src, b.tgt_in, b.tgt_out)
            (loss / tokens).backward()
            if self.bf16:
                torch._foreach_add_([m.grad for m in self.master], [w.grad for w in self.weights])
                for w in self.weights:
                    w.grad = None
            loss_sum += loss.detach().float()
        updated = [m for m in self.master if m.grad is not None]
        grads = [m.grad for m in updated]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if self.clip > 0:  # scales the gradients by clip / (norm + 1e-6) where that is below 1, on the device
            torch.nn.utils.clip_grads_with_norm_(updated, self.clip, norm)
        broken = ~torch.isfinite(loss_sum) | ~torch.isfinite(norm)
        self.optimizer.step()
        self.schedule.step()
        if self.bf16:
            torch._foreach_copy_([w.data for w in self.weights], self.master)
            torch._foreach_zero_(grads)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        loss_value, bad = torch.stack([loss_sum, broken.float()]).tolist()  # the step's one read
        if bad:
            raise RuntimeError(f"the plain loop's loss or gradient norm is not finite (loss {loss_value:g})")
        return loss_value


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


def build_trainer(data: Path, run_dir: Path, extra: tuple[str, ...] = (), shape: Shape = TINY):
    """The Trainer of the benchmark: one process, 2 micro-batches a step, eager; fp32 ZeRO-0 (tiny.yaml's)
    unless ``extra`` (``--set`` overrides, applied last) says otherwise."""
    from megaformer.train.trainer import Trainer

    sets = [
        f"data.path={data}", *shape.sets(), f"data.max_tokens={MICRO_TOKENS}",
        f"train.tokens_per_step={2 * MICRO_TOKENS}", "data.num_workers=0", "train.compile=false",
        "train.eval_interval=0", "train.save_interval=0", "train.log_interval=1000000", "train.max_steps=100000",
        f"train.label_smoothing={SMOOTHING}", "parallel.backend=gloo",
    ]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "tiny.yaml", sets + list(extra))
    ctx = ParallelContext.initialize(cfg.parallel, 0, 1, single_process_group=True)
    trainer = Trainer(cfg, ctx, run_dir, resume="none")
    trainer.engine.train()
    return trainer, ctx


def measure(
    steps: int,
    warmup: int,
    log,
    device: str = "cpu",
    precision: str = "bf16",
    zero_stage: int = 1,
    clip_grad: float = 0.0,
    shape: Shape = TINY,
    optimizer: str = "auto",
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        if cli.main(["prepare", "--synthetic", "4000", "--out", str(data), "--quiet"]) != 0:
            raise SystemExit("host_overhead: prepare failed")
        sets = (
            f"train.precision={precision}", f"train.zero_stage={zero_stage}", f"train.clip_grad={clip_grad}",
            *(("parallel.backend=nccl",) if device == "cuda" else ()),
            *((f"train.optimizer={optimizer}",) if optimizer != "auto" else ()),  # auto: the Trainer's own pick
        )  # fmt: skip
        trainer, ctx = build_trainer(data, Path(tmp) / "run", sets, shape)
        try:
            return _compare(trainer, steps, warmup, log, shape)
        finally:
            ctx.destroy()


def _compare(trainer, steps: int, warmup: int, log, shape: Shape = TINY) -> dict:
    torch.manual_seed(0)
    device, t = trainer.ctx.device, trainer.cfg.train
    done = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with torch.device(device):  # the reference's weights, buffers and (later) optimizer state: made on the device
        ref = Reference(trainer.cfg.data.vocab_size, shape)
    plain = PlainLoop(ref, t, t.precision, device)
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
        plain.step(micro)
        done()
        reference = time.perf_counter() - began
        if i >= warmup:
            times["megaformer"].append(mega)
            times["reference"].append(reference)
        log(f"step {i + 1}/{warmup + steps}: megaformer {mega * 1e3:.1f} ms, reference {reference * 1e3:.1f} ms")
    with DeviceReads() as reads:
        trainer.step(flags)
    syncs = cuda_syncs(lambda: trainer.step(flags), device)
    micro = [m.batch.to(device) for m in taken[-1]]
    done()
    with DeviceReads() as ref_reads:
        plain.step(micro)
    ref_syncs = cuda_syncs(lambda: plain.step(micro), device)
    b = micro[0]
    model, smoothing = trainer.model, t.label_smoothing
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
        "reference_device_reads_per_step": ref_reads.count,
        "device_reads_target": reads_target(engine_of(trainer), t.precision, t.zero_stage, t.clip_grad),
        "megaformer_cuda_syncs_per_step": syncs,  # None off CUDA
        "reference_cuda_syncs_per_step": ref_syncs,
        "device": str(device),
        "engine": engine_of(trainer),
        "precision": t.precision,
        "zero_stage": t.zero_stage,
        "clip_grad": t.clip_grad,
        "d_model": shape.d_model,
        "layers": LAYERS,
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
    parser.add_argument(
        "--precision", choices=("bf16", "fp32"), default="bf16", help="both models' precision (default: %(default)s)"
    )
    parser.add_argument(
        "--zero", type=int_range(0, 2), default=1, help="the Trainer's ZeRO stage (default: %(default)s)"
    )
    parser.add_argument(
        "--optimizer",
        choices=("auto", "deepspeed", "lean"),
        default="auto",
        help="train.optimizer (default: %(default)s, the Trainer's pick: lean on one GPU, DeepSpeed on a CPU)",
    )
    parser.add_argument(
        "--clip-grad", type=finite_float(0.0), default=0.0, help="clip to this gradient norm, 0 = off (the presets')"
    )
    parser.add_argument(
        "--shape", choices=tuple(SHAPES), default="tiny", help="the layers' width (default: %(default)s; big: a GPU's)"
    )
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
        shape = SHAPES[args.shape]
        r = measure(
            args.steps, args.warmup, log, args.device, args.precision, args.zero, args.clip_grad, shape, args.optimizer
        )
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['engine']} {r['precision']} (train.zero_stage={r['zero_stage']}), d_model {r['d_model']}, {r['layers']} + {r['layers']} layers, "
            f"{r['micro_batches_per_step']} micro-batches a step on {r['device']}"
        )
        print(
            f"host time per step: megaformer {r['megaformer_step_ms']} ms, reference {r['reference_step_ms']} ms: "
            f"{r['host_time_ratio']}x (target <= 1.5)"
        )
        print(
            f"aten ops per micro-batch: megaformer {r['megaformer_ops_per_micro_batch']}, reference "
            f"{r['reference_ops_per_micro_batch']}: {r['ops_ratio']}x (target <= 1.3)"
        )
        syncs, ref_syncs = r["megaformer_cuda_syncs_per_step"], r["reference_cuda_syncs_per_step"]
        print(
            f"device reads in a steady step: megaformer {r['megaformer_device_reads_per_step']} (target <= "
            f"{r['device_reads_target']}), reference {r['reference_device_reads_per_step']}"
            + (f"; CUDA synchronisations {syncs} (reference {ref_syncs})" if syncs is not None else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
