"""Our column- and row-parallel linear layers against megatron-core's, on the same weights.

Two gloo processes on the CPU build each layer twice, once from
``megaformer.parallel`` and once from ``megatron.core.tensor_parallel``, load the
same shards of one seeded full weight into both, feed the same input, backward the
same upstream gradient, and compare outputs, input gradients and weight / bias
gradients. One spawn runs every case and writes each rank's max differences to JSON;
the tests below only read them.

Layouts: ours is batch-first ``(batch, seq, hidden)`` and splits the sequence along
dim 1; megatron is ``(seq, batch, hidden)`` and splits along dim 0. Megatron layers
return ``(output, output_bias)``; with ``skip_bias_add=False`` the bias is already in
the output.

What megatron-core 0.16 needs on a CPU:

* ``use_cpu_initialization=True``: otherwise parameters are allocated on
  ``cuda.current_device()`` and initialised through the CUDA RNG tracker (which is
  why ``model_parallel_cuda_manual_seed`` is never needed here). The compared layers
  use ``perform_initialization=False`` since the weights are copied in; the
  ``shard_layout`` case lets megatron initialise on the CPU to check that its shards
  are the slices :func:`shard_full` cuts. ``gradient_accumulation_fusion=False`` (the
  default; it needs APEX's CUDA extension). ``async_tensor_model_parallel_allreduce``
  is ignored by 0.16. Megatron's layers get our TP group explicitly as ``tp_group``,
  after ``parallel_state.initialize_model_parallel`` has been checked to agree with it.
* Its gather / reduce-scatter buffers (``gather_output=True``, sequence parallelism,
  the global memory buffer) are allocated with ``device=torch.cuda.current_device()``.
  For those cases :func:`_megatron_buffers_on_cpu` points that call at the CPU while
  megatron runs; nothing numerical changes. If megatron still cannot run such a case
  here, the case is skipped with megatron's error as the reason.
* With sequence parallelism megatron leaves the gradient of the row-parallel bias
  partial (a sum over this rank's part of the sequence): ``finalize_model_grads``
  all-reduces it over the TP group later, for parameters tagged ``sequence_parallel``.
  We do that all-reduce here; our layer does it inside its backward.

megatron-core is only in the optional ``ref`` extra; without it the module is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

with warnings.catch_warnings():
    # megatron-core warns at import that Transformer Engine and Apex are missing.
    warnings.simplefilter("ignore")
    pytest.importorskip(
        "megatron.core",
        reason="megatron-core is not installed (optional `ref` extra: pip install -e '.[ref]')",
    )

from launcher.local import spawn  # noqa: E402
from megaformer.config import ParallelConfig  # noqa: E402
from megaformer.parallel import (  # noqa: E402
    LOCAL,
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    TPGroup,
    shard_full,
)

TP = 2
BATCH, SEQ, D_IN, D_OUT = 3, 6, 16, 24  # SEQ divisible by TP for sequence parallelism
D_FF = 32
TOL = 1e-5  # on max |ours - megatron| / max(1, max |megatron|), fp32

# case name -> (tp, needs the CPU buffer shim). The shim cases may be skipped.
CASES: dict[str, tuple[int, bool]] = {
    "shard_layout": (TP, False),
    "column": (TP, False),
    "column_no_bias": (TP, False),
    "column_gather_output": (TP, True),
    "row": (TP, False),
    "mlp": (TP, False),
    "column_sequence_parallel": (TP, True),
    "row_sequence_parallel": (TP, True),
    "mlp_sequence_parallel": (TP, True),
    "column_tp1": (1, False),
    "row_tp1": (1, False),
}


# ---- helpers, run inside the spawned ranks ------------------------------------------------


def _randn(seed: int, *shape: int) -> torch.Tensor:
    """A full (TP=1) tensor, the same on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _sb(x: torch.Tensor) -> torch.Tensor:
    """(batch, seq, ...) <-> (seq, batch, ...), as a fresh leaf."""
    return x.detach().transpose(0, 1).contiguous().requires_grad_(x.requires_grad)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _diff(ours: torch.Tensor | None, ref: torch.Tensor | None) -> list[float]:
    """[max |ours - ref|, max |ref|]; a missing gradient on either side is a failure."""
    if ours is None or ref is None:
        return [float("inf"), 0.0]
    return [float((ours.detach() - ref.detach()).abs().max()), float(ref.detach().abs().max())]


@contextlib.contextmanager
def _megatron_buffers_on_cpu():
    """Let megatron's ``torch.empty(..., device=torch.cuda.current_device())`` allocate on the CPU."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


class _MegatronCannotRun(Exception):
    """megatron-core raised while running its side of a case on this CPU."""


def _megatron_config(tp: int, sequence_parallel: bool = False):
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=False,
        gradient_accumulation_fusion=False,
    )


def _megatron_column(cfg, group, d_in: int, d_out: int, bias: bool = True, gather_output: bool = False):
    from megatron.core.tensor_parallel import ColumnParallelLinear as MColumn

    return MColumn(
        d_in,
        d_out,
        config=cfg,
        init_method=torch.nn.init.zeros_,
        bias=bias,
        gather_output=gather_output,
        skip_bias_add=False,
        tp_group=group,
    )


def _megatron_row(cfg, group, d_in: int, d_out: int, bias: bool = True):
    from megatron.core.tensor_parallel import RowParallelLinear as MRow

    return MRow(
        d_in,
        d_out,
        config=cfg,
        init_method=torch.nn.init.zeros_,
        bias=bias,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=group,
    )


def _load(ours: torch.nn.Module, ref: torch.nn.Module, seed: int, dim: int, tp: TPGroup) -> None:
    """Load this rank's shard of one seeded full weight (and bias) into both layers."""
    out_features, in_features = ours.weight.shape[0], ours.weight.shape[1]
    full_out = out_features * (tp.size if dim == 0 else 1)
    full_in = in_features * (tp.size if dim == 1 else 1)
    weight = shard_full(_randn(seed, full_out, full_in), dim, 1, tp)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
        if ours.bias is not None:
            bias = shard_full(_randn(seed + 1, full_out), 0 if dim == 0 else None, 1, tp)
            ours.bias.copy_(bias)
            ref.bias.copy_(bias)


def _compare(
    y: torch.Tensor, y_ref: torch.Tensor, x: torch.Tensor, x_ref: torch.Tensor, **layers: tuple
) -> dict[str, list[float]]:
    """Output and input gradient (megatron's transposed to batch-first), then each
    ``name=(ours, megatron)`` layer's weight and bias gradients."""
    out = {"output": _diff(y, y_ref.transpose(0, 1)), "input.grad": _diff(x.grad, x_ref.grad.transpose(0, 1))}
    for name, (ours, ref) in layers.items():
        out[f"{name}.weight.grad"] = _diff(ours.weight.grad, ref.weight.grad)
        if ours.bias is not None or ref.bias is not None:
            out[f"{name}.bias.grad"] = _diff(
                ours.bias.grad if ours.bias is not None else None, ref.bias.grad if ref.bias is not None else None
            )
    return out


# ---- the cases: each returns {tensor name: [max diff, max |megatron|]} ------------------------


def _case_shard_layout(tp: TPGroup, group, shim: bool) -> dict[str, list[float]]:
    """shard_full cuts a full weight the way megatron's own CPU initialisation does."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear as MColumn
    from megatron.core.tensor_parallel import RowParallelLinear as MRow

    cfg = ModelParallelConfig(tensor_model_parallel_size=tp.size, use_cpu_initialization=True)
    common = dict(config=cfg, init_method=torch.nn.init.normal_, bias=False, keep_master_weight_for_test=True)
    col = MColumn(D_IN, D_OUT, **common, tp_group=group)
    row = MRow(D_IN, D_OUT, **common, input_is_parallel=True, skip_bias_add=False, tp_group=group)
    return {
        "column weight shard": _diff(shard_full(col.master_weight, 0, 1, tp), col.weight),
        "row weight shard": _diff(shard_full(row.master_weight, 1, 1, tp), row.weight),
    }


def _column(tp: TPGroup, group, shim: bool, bias: bool = True, gather_output: bool = False) -> dict[str, list[float]]:
    ours = ColumnParallelLinear(D_IN, D_OUT, tp, bias=bias, gather_output=gather_output)
    x = _leaf(_randn(10, BATCH, SEQ, D_IN))  # replicated input
    d_local = D_OUT if gather_output else D_OUT // tp.size
    grad = _randn(11, BATCH, SEQ, D_OUT)
    grad = grad if gather_output else shard_full(grad, 2, 1, tp)
    try:
        with _megatron_buffers_on_cpu() if shim else contextlib.nullcontext():
            ref = _megatron_column(_megatron_config(tp.size), group, D_IN, D_OUT, bias, gather_output)
            _load(ours, ref, 12, 0, tp)
            x_ref = _sb(x)
            y_ref, y_bias = ref(x_ref)  # (seq, batch, d_local)
            assert y_bias is None
            y_ref.backward(_sb(grad))
    except Exception as err:
        raise _MegatronCannotRun(err) from err
    y = ours(x)  # (batch, seq, d_local)
    y.backward(grad)
    assert y.shape == (BATCH, SEQ, d_local), y.shape
    return _compare(y, y_ref, x, x_ref, layer=(ours, ref))


def _case_row(tp: TPGroup, group, shim: bool) -> dict[str, list[float]]:
    ours = RowParallelLinear(D_IN, D_OUT, tp)
    ref = _megatron_row(_megatron_config(tp.size), group, D_IN, D_OUT)
    _load(ours, ref, 22, 1, tp)
    x = _leaf(shard_full(_randn(20, BATCH, SEQ, D_IN), 2, 1, tp))  # input split by columns
    grad = _randn(21, BATCH, SEQ, D_OUT)
    x_ref = _sb(x)
    y_ref, _ = ref(x_ref)  # (seq, batch, D_OUT)
    y_ref.backward(_sb(grad))
    y = ours(x)  # (batch, seq, D_OUT)
    y.backward(grad)
    return _compare(y, y_ref, x, x_ref, layer=(ours, ref))


def _mlp(tp: TPGroup, group, shim: bool, sequence_parallel: bool) -> dict[str, list[float]]:
    """Column -> GELU -> row, as in a Transformer block; with sequence parallelism the
    input and output are this rank's part of the sequence."""
    fc1 = ColumnParallelLinear(D_IN, D_FF, tp, sequence_parallel=sequence_parallel)
    fc2 = RowParallelLinear(D_FF, D_IN, tp, sequence_parallel=sequence_parallel)
    x_full, grad_full = _randn(30, BATCH, SEQ, D_IN), _randn(31, BATCH, SEQ, D_IN)
    x = _leaf(shard_full(x_full, 1, 1, tp) if sequence_parallel else x_full)
    grad = shard_full(grad_full, 1, 1, tp) if sequence_parallel else grad_full
    try:
        with _megatron_buffers_on_cpu() if shim else contextlib.nullcontext():
            cfg = _megatron_config(tp.size, sequence_parallel)
            ref1 = _megatron_column(cfg, group, D_IN, D_FF)
            ref2 = _megatron_row(cfg, group, D_FF, D_IN)
            _load(fc1, ref1, 32, 0, tp)
            _load(fc2, ref2, 34, 1, tp)
            x_ref = _sb(x)  # (seq or seq / tp, batch, D_IN)
            h_ref, _ = ref1(x_ref)
            y_ref, _ = ref2(F.gelu(h_ref))
            y_ref.backward(_sb(grad))
            if sequence_parallel:
                # finalize_model_grads' job in megatron: sum the partial grads of
                # parameters tagged sequence_parallel (the row bias) over the TP group.
                assert getattr(ref2.bias, "sequence_parallel", False)
                dist.all_reduce(ref2.bias.grad, group=group)
    except Exception as err:
        raise _MegatronCannotRun(err) from err
    y = fc2(F.gelu(fc1(x)))
    y.backward(grad)
    assert y.shape == x.shape, (y.shape, x.shape)
    return _compare(y, y_ref, x, x_ref, fc1=(fc1, ref1), fc2=(fc2, ref2))


def _case_column_sequence_parallel(tp: TPGroup, group, shim: bool) -> dict[str, list[float]]:
    ours = ColumnParallelLinear(D_IN, D_OUT, tp, sequence_parallel=True)
    x = _leaf(shard_full(_randn(40, BATCH, SEQ, D_IN), 1, 1, tp))  # (batch, seq / tp, D_IN)
    grad = shard_full(_randn(41, BATCH, SEQ, D_OUT), 2, 1, tp)  # (batch, seq, D_OUT / tp)
    try:
        with _megatron_buffers_on_cpu():
            ref = _megatron_column(_megatron_config(tp.size, sequence_parallel=True), group, D_IN, D_OUT)
            _load(ours, ref, 42, 0, tp)
            x_ref = _sb(x)  # (seq / tp, batch, D_IN)
            y_ref, _ = ref(x_ref)  # (seq, batch, D_OUT / tp)
            y_ref.backward(_sb(grad))
    except Exception as err:
        raise _MegatronCannotRun(err) from err
    y = ours(x)
    y.backward(grad)
    return _compare(y, y_ref, x, x_ref, layer=(ours, ref))


def _case_row_sequence_parallel(tp: TPGroup, group, shim: bool) -> dict[str, list[float]]:
    ours = RowParallelLinear(D_IN, D_OUT, tp, sequence_parallel=True)
    x = _leaf(shard_full(_randn(50, BATCH, SEQ, D_IN), 2, 1, tp))  # (batch, seq, D_IN / tp)
    grad = shard_full(_randn(51, BATCH, SEQ, D_OUT), 1, 1, tp)  # (batch, seq / tp, D_OUT)
    try:
        with _megatron_buffers_on_cpu():
            ref = _megatron_row(_megatron_config(tp.size, sequence_parallel=True), group, D_IN, D_OUT)
            _load(ours, ref, 52, 1, tp)
            x_ref = _sb(x)
            y_ref, _ = ref(x_ref)  # (seq / tp, batch, D_OUT)
            y_ref.backward(_sb(grad))
            assert getattr(ref.bias, "sequence_parallel", False)
            dist.all_reduce(ref.bias.grad, group=group)  # finalize_model_grads' job in megatron
    except Exception as err:
        raise _MegatronCannotRun(err) from err
    y = ours(x)
    y.backward(grad)
    return _compare(y, y_ref, x, x_ref, layer=(ours, ref))


_RUNNERS: dict[str, Callable[[TPGroup, object, bool], dict[str, list[float]]]] = {
    "shard_layout": _case_shard_layout,
    "column": _column,
    "column_no_bias": lambda tp, group, shim: _column(tp, group, shim, bias=False),
    "column_gather_output": lambda tp, group, shim: _column(tp, group, shim, gather_output=True),
    "row": _case_row,
    "mlp": lambda tp, group, shim: _mlp(tp, group, shim, sequence_parallel=False),
    "column_sequence_parallel": _case_column_sequence_parallel,
    "row_sequence_parallel": _case_row_sequence_parallel,
    "mlp_sequence_parallel": lambda tp, group, shim: _mlp(tp, group, shim, sequence_parallel=True),
    "column_tp1": _column,
    "row_tp1": _case_row,
}


def _run_cases(tp_size: int, tp: TPGroup, group, results: dict) -> None:
    for name, (size, shim) in CASES.items():
        if size != tp_size:
            continue
        torch.manual_seed(0)
        try:
            results[name] = {"diffs": _RUNNERS[name](tp, group, shim)}
        except _MegatronCannotRun as err:
            if not shim:
                raise
            from megatron.core import __version__

            cause = f"{type(err.__cause__).__name__}: {err.__cause__}"
            results[name] = {
                "skip": f"megatron-core {__version__} cannot run this case on CPU/gloo, "
                f"even with its buffers on the CPU: {cause}"
            }


def _worker(out_dir: str) -> int:
    """One rank: every case at TP=2, then at TP=1; this rank's results to JSON."""
    warnings.simplefilter("ignore")  # megatron's import-time and deprecation warnings
    from megatron.core import parallel_state

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict[str, dict] = {}

    ctx = ParallelContext.initialize(ParallelConfig(tp=TP, backend="gloo"), rank, world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    # Both frameworks must agree on the grid; megatron's layers then get our group explicitly.
    assert parallel_state.get_tensor_model_parallel_world_size() == ctx.tp.size
    assert parallel_state.get_tensor_model_parallel_rank() == ctx.tp.rank
    _run_cases(TP, ctx.tp, ctx.tp.group, results)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    _run_cases(1, LOCAL, parallel_state.get_tensor_model_parallel_group(), results)
    parallel_state.destroy_model_parallel()

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    ctx.destroy()
    return 0


# ---- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every case on both ranks, from one spawn of two gloo processes."""
    out = tmp_path_factory.mktemp("megatron_reference")
    code = spawn(_worker, TP, str(out), timeout_s=180)
    assert code == 0, f"the spawned ranks exited with status {code}; their tracebacks are in captured stderr"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(TP)]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_megatron_core(results: list[dict], case: str) -> None:
    for rank, per_rank in enumerate(results):
        result = per_rank[case]
        if "skip" in result:
            pytest.skip(result["skip"])
        bad = {
            name: f"max |ours - megatron| = {diff:.3g} (max |megatron| = {scale:.3g})"
            for name, (diff, scale) in result["diffs"].items()
            if not diff <= TOL * max(1.0, scale)
        }
        assert not bad, f"{case}, rank {rank}: {bad}"
