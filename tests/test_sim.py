"""The step's simulation (megaformer/sim): what it records from the real code, and how it prices it.

The recorder's figures are checked against counts worked out from the model (matmul FLOPs of a
step), the timeline against hand-worked cases; the GPU step's properties the design promises
(one host read a step, the dropout one operator, no fp32 copy of the logits) are read off the
record of the real code on the meta device.
"""

from __future__ import annotations

import pytest
import torch

from megaformer.config import load_config
from megaformer.parallel import fused
from megaformer.sim.ops import Op
from megaformer.sim.roofline import GPUS, Device, timeline
from megaformer.sim.step import MicroShape, record_step, step_shape

TINY = load_config("configs/tiny.yaml", ["train.precision=bf16", "model.dropout=0.1", "train.label_smoothing=0.1"])


def _op(name="mm", flops=0.0, nbytes=0.0, kernels=1, read=False, gemm=True) -> Op:
    return Op(name, flops, nbytes, kernels, read, gemm, True, "bfloat16")


def test_roofline_prices_a_matmul_by_flops_and_an_elementwise_op_by_bytes():
    h200 = GPUS["h200"]
    assert h200.device_seconds(_op(flops=989e12 * 0.7 * 1e-3, nbytes=1e3)) == pytest.approx(1e-3)
    assert h200.device_seconds(_op("add", nbytes=4.8e12 * 0.8 * 1e-3, gemm=False)) == pytest.approx(1e-3)
    assert h200.device_seconds(_op("add", nbytes=8, gemm=False)) == h200.min_kernel_s  # a launch at least
    assert h200.device_seconds(_op("view", kernels=0)) == 0.0


def test_timeline_overlaps_host_and_device_and_a_host_read_serialises_them():
    dev = Device("x", 1e12, 1e12, 1e12, gemm_efficiency=1, memory_efficiency=1, min_kernel_s=0, host_op_s=1e-3)
    slow = _op(flops=5e9)  # 5 ms on the device, 1 ms of host
    assert timeline([slow] * 4, dev).seconds == pytest.approx(21e-3)  # the host queues ahead: 1 + 4 x 5
    read = _op("_local_scalar_dense", kernels=0, read=True, gemm=False)
    # the read (queued at 3 ms) waits for the 2nd kernel's end (11 ms); the 3rd is queued 1 ms later, runs 5,
    # and the 4th runs after it
    assert timeline([slow, slow, read, slow, slow], dev).seconds == pytest.approx(11e-3 + 1e-3 + 5e-3 + 5e-3)
    cpu = Device("cpu", 1e12, 1e12, 1e12, gemm_efficiency=1, memory_efficiency=1, min_kernel_s=0, host_op_s=1e-3)
    cpu = Device(**{**cpu.__dict__, "overlap": False})
    assert timeline([slow] * 4, cpu).seconds == pytest.approx(24e-3)  # one thread: the sum


def test_step_shape_follows_the_step_plan():
    cfg = load_config("configs/transformer_big.yaml", ["data.max_tokens=4096"])
    shapes = step_shape(cfg, 13)
    assert len(shapes) == 6 and shapes[0] == MicroShape(315, 13, 13)  # 25,000 tokens in micro-batches of <= 4,096


def test_gpu_step_record_counts_the_models_matmuls_reads_once_and_fuses_dropout():
    shapes = [MicroShape(8, 10, 12)] * 2
    ops = record_step(TINY, shapes, "meta")
    names = [op.name for op in ops]
    m, n_src, n_tgt = TINY.model, 8 * 10, 8 * 12
    d, f, v = m.d_model, m.d_ff, 1024  # the 1,000-piece vocabulary padded to 1,024
    # the linear layers' FLOPs (forward 2, backward 4 per multiply-add), per micro-batch
    enc = m.encoder_layers * n_src * (4 * d * d + 2 * d * f)
    dec = m.decoder_layers * (n_tgt * (4 * d * d + 2 * d * d + 2 * d * f) + n_src * 2 * d * d)
    linear = 6 * (enc + dec + n_tgt * d * v)
    matmul = sum(op.flops for op in ops if op.name in ("mm", "addmm", "bmm"))
    assert matmul == pytest.approx(2 * linear)
    assert sum(op.host_read for op in ops) == 1  # the step's one read (its all-reduce's result)
    masks = 2 * (1 + 2 * m.encoder_layers + 1 + 3 * m.decoder_layers)  # embeddings and residuals, two micro-batches
    assert names.count("dropout") == 2 * masks  # forward and backward, one operator each
    assert "bitwise_xor_" not in names and names.count("ce_grad") == 2
    assert all(op.on_device for op in ops if op.kernels)
    with fused.unfused():
        eager = record_step(TINY, shapes, "meta")
    assert sum(op.kernels for op in eager) > sum(op.kernels for op in ops) + 10 * masks


def test_cpu_record_runs_the_cpu_code_path_on_fake_tensors():
    cfg = load_config("configs/tiny.yaml")
    ops = record_step(cfg, [MicroShape(4, 9, 9)], "cpu")
    names = {op.name for op in ops}
    assert "dropout" not in names and "bitwise_xor_" in names  # the CPU keeps its own masks
    assert not torch.is_tensor(ops[0])


def test_a_cpu_record_can_be_made_again_and_timed_kernel_by_kernel():
    from megaformer.sim.calibrate import op_seconds

    cfg = load_config("configs/tiny.yaml")
    ops = record_step(cfg, [MicroShape(4, 9, 9)], "cpu")
    kernels = {op.signature for op in ops if op.kernels}
    timed = op_seconds(ops, repeats=1)
    assert len(timed) >= 0.95 * len(kernels)  # the few left are priced by the roofline
    assert all(seconds > 0 for seconds in timed.values())


def test_gpu_sim_refuses_bad_input_in_one_line(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_sim.py"
    spec = importlib.util.spec_from_file_location("gpu_sim", path)
    gpu_sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_sim)
    for argv, said in ((["--len", "0"], "argument --len: must be at least 2"), (["--gpu", "h300"], "argument --gpu")):
        with pytest.raises(SystemExit) as code:
            gpu_sim.main(argv)
        assert code.value.code == 2 and said in capsys.readouterr().err
    assert gpu_sim.main(["--config", "no-such.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "gpu_sim: error: config file not found: no-such.yaml"


def test_the_feed_is_host_work_before_the_steps_first_kernel():
    from megaformer.sim.feed import feed_op

    dev = Device("x", 1e12, 1e12, 1e12, gemm_efficiency=1, memory_efficiency=1, min_kernel_s=0, host_op_s=1e-3)
    slow = _op(flops=5e9)  # 5 ms on the device, 1 ms of host
    feed = feed_op(10e-3)
    assert feed.kernels == 0 and not feed.on_device
    # the host feeds (10 ms and its dispatch), then queues the kernel: it ends at 12 + 5
    assert timeline([feed, slow], dev).seconds == pytest.approx(17e-3)
    cpu = Device(**{**dev.__dict__, "overlap": False})
    assert timeline([feed, slow, slow], cpu).seconds == pytest.approx(11e-3 + 2 * 6e-3)


def test_the_feed_is_timed_alone_and_a_loader_started_each_epoch_costs_the_main_process(synthetic_data):
    from megaformer.sim.feed import feed_cost

    # 300 pairs of ~13 tokens, steps of 512: an epoch every ~7 steps
    cfg = load_config("configs/tiny.yaml", ["train.tokens_per_step=512", "data.max_tokens=256", "data.num_workers=1"])
    restarted = feed_cost(cfg, synthetic_data, steps=14, restart_each_epoch=True)
    kept = feed_cost(cfg, synthetic_data, steps=14)
    assert restarted.epochs >= 1 and kept.epochs >= 1
    assert kept.target_tokens == pytest.approx(restarted.target_tokens, rel=0.05)  # the same plan of batches
    # an epoch's start decodes its samples on the calling thread: the mean step costs more than a steady one
    assert restarted.cpu_s > 1.5 * restarted.steady_cpu_s
    # a persistent loader worker decodes in its own process: the main process's share is smaller
    assert kept.cpu_s < restarted.cpu_s
    assert restarted.seconds_for(2 * restarted.target_tokens) == pytest.approx(2 * restarted.cpu_s)
