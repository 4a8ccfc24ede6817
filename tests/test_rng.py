"""Dropout streams: device-neutral state, visible forks, the keep-scale in every precision."""

import json

import torch

from megaformer.parallel import LOCAL, DropoutRNG, TPGroup


def _masks(rng: DropoutRNG, n: int, shape=(4, 6, 8), dtype=torch.float32) -> list[torch.Tensor]:
    x = torch.ones(shape, dtype=dtype)
    return [rng.keep_mask(x, 0.3, None) for _ in range(n)]


def test_state_is_plain_integers_and_replays_the_same_masks():
    rng = DropoutRNG(7, LOCAL, stream=3)
    _masks(rng, 5)
    state = rng.state_dict()
    # What a checkpoint stores: integers only, no generator bytes of one device kind.
    assert json.loads(json.dumps(state)) == state
    assert all(isinstance(v, int) for pair in state.values() for v in pair)
    expected = _masks(rng, 4)
    fresh = DropoutRNG(123, LOCAL, stream=0)  # another seed: the loaded state must be what counts
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(a, b) for a, b in zip(_masks(fresh, 4), expected))


def test_streams_differ_by_seed_and_data_stream():
    a, b, c = (_masks(DropoutRNG(s, LOCAL, stream=v), 1)[0] for s, v in ((1, 0), (2, 0), (1, 1)))
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_generator_lives_on_the_device_of_the_masked_tensor():
    rng = DropoutRNG(1, LOCAL)
    assert rng.shared.generator is None  # nothing is created on an implicit default device
    rng.keep_mask(torch.ones(3, device="cpu"), 0.1, None)
    assert rng.shared.generator.device == torch.device("cpu")
    if torch.cuda.is_available():
        x = torch.ones(3, device="cuda")
        rng.keep_mask(x, 0.1, None)
        assert rng.shared.generator.device == x.device


def test_fork_switches_visibly_and_keeps_what_the_block_drew():
    rng = DropoutRNG(1, LOCAL)
    outer_before = rng.state_dict()
    stream_state = DropoutRNG.initial_state(1, 0, stream=5)
    with rng.fork(stream_state):
        inside = _masks(rng, 2)
    assert rng.state_dict() == outer_before  # the outer streams are back
    assert stream_state["shared"][1] == 2  # the fork's state advanced by the two masks
    replay = DropoutRNG(1, LOCAL, stream=5)
    assert all(torch.equal(a, b) for a, b in zip(_masks(replay, 2), inside))


def test_bf16_dropout_scales_in_fp32_and_rounds_once():
    """bf16(1/0.9) = 1.109375 would bias every kept value; the scale must be applied in the compute precision."""
    x = torch.randn(64, 512).to(torch.bfloat16)
    for p in (0.1, 0.3):
        rng = DropoutRNG(3, LOCAL)
        start = rng.state_dict()
        y = rng.dropout(x, p, training=True)
        with rng.fork(start):
            keep = rng.keep_mask(x.float(), p, None)
        levels = 1 << 16
        drop = round(p * levels)
        reference = (x.float() * keep * (levels / (levels - drop))).to(torch.bfloat16)
        assert torch.equal(y, reference), f"p={p}: bf16 dropout differs from the fp32 computation rounded once"


def test_exact_mode_slices_are_the_full_mask():
    full = DropoutRNG(5, LOCAL)
    x = torch.ones(2, 3, 8)
    whole = full.keep_mask(x, 0.2, None)
    for rank in range(2):
        tp = TPGroup(group=None, size=2, rank=rank)
        part = DropoutRNG(5, tp).keep_mask(torch.ones(2, 3, 4), 0.2, split_dim=-1)
        assert torch.equal(part, whole[..., rank * 4 : (rank + 1) * 4])
