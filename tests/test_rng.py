"""Dropout streams: device-neutral state, visible forks, the keep-scale in every precision."""

import json

import pytest
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


def test_masks_are_made_on_the_device_of_the_masked_tensor_and_are_the_same_on_every_device():
    rng = DropoutRNG(1, LOCAL)
    start = rng.state_dict()
    cpu = rng.keep_mask(torch.ones(5, 7, device="cpu"), 0.1, None)
    assert cpu.device == torch.device("cpu")
    if torch.cuda.is_available():
        with rng.fork(start):
            gpu = rng.keep_mask(torch.ones(5, 7, device="cuda"), 0.1, None)
        assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)


def test_masks_keep_one_minus_p_and_are_independent_of_each_other():
    rng = DropoutRNG(2, LOCAL)
    x = torch.ones(256, 1024)
    a, b = rng.keep_mask(x, 0.3, None), rng.keep_mask(x, 0.3, None)
    n = x.numel()
    assert abs(a.mean().item() - 0.7) < 4 * (0.21 / n) ** 0.5
    both_dropped = ((1 - a) * (1 - b)).mean().item()
    assert abs(both_dropped - 0.09) < 4 * (0.09 * 0.91 / n) ** 0.5
    # Neighbouring elements share a 64-bit word: their bits must not be related either.
    pairs = ((1 - a[:, 0::2]) * (1 - a[:, 1::2])).mean().item()
    assert abs(pairs - 0.09) < 4 * (0.09 * 0.91 / (n // 2)) ** 0.5


def test_a_region_draws_its_keys_first_and_its_masks_are_those_drawn_one_by_one():
    x = torch.ones(3, 8)
    one_by_one = _masks(DropoutRNG(4, LOCAL), 3, shape=x.shape)
    rng = DropoutRNG(4, LOCAL)
    with rng.region({"shared": 3, "local": 0}, x.device):
        assert rng.state_dict()["shared"][1] == 3  # all three keys drawn when the region opens
        inside = _masks(rng, 3, shape=x.shape)
    assert all(torch.equal(a, b) for a, b in zip(inside, one_by_one))


def test_integer_keys_and_kept_counters_make_the_masks_of_tensor_keys():
    """An eager layer's keys are integers added to counters kept between masks of growing and shrinking sizes;
    a compiled layer's are tensors filled on the device: the masks must be the same."""
    shapes = [(3, 8), (5, 7, 9), (2, 3), (4, 6, 10), (1, 5)]  # 5 and 15 elements: a partial last word
    eager, filled = DropoutRNG(6, LOCAL), DropoutRNG(6, LOCAL)
    with eager.region({"shared": len(shapes)}, None), filled.region({"shared": len(shapes)}, torch.device("cpu")):
        assert all(isinstance(k, int) for k in eager.keys["shared"])
        assert all(isinstance(k, torch.Tensor) for k in filled.keys["shared"])
        for shape in shapes:
            x = torch.ones(shape)
            assert torch.equal(eager.keep_mask(x, 0.3, None), filled.keep_mask(x, 0.3, None)), shape


def test_a_region_that_makes_more_or_fewer_masks_than_it_drew_is_an_error():
    rng = DropoutRNG(4, LOCAL)
    with pytest.raises(RuntimeError, match="left"):
        with rng.region({"shared": 2}, torch.device("cpu")):
            _masks(rng, 1)
    with pytest.raises(RuntimeError, match="more shared masks"):
        with rng.region({"shared": 1}, torch.device("cpu")):
            _masks(rng, 2)
    assert rng.keys is None  # the region is closed after an error


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


def test_mask_bits_are_splitmix64_computed_in_python_integers():
    """The bits every device must produce: SplitMix64 (Steele et al. 2014) written with Python's integers."""
    from megaformer.parallel.rng import _random_bits16

    def splitmix64(state: int) -> int:
        z = state & (2**64 - 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)

    key = 0x1234_5678_9ABC_DEF
    expected = []
    for word in range(1, 4):  # 10 elements use words 1..3 (four 16-bit lanes each, low lane first)
        z = splitmix64(key + word * 0x9E3779B97F4A7C15)
        for lane in range(4):
            bits = (z >> (16 * lane)) & 0xFFFF
            expected.append(bits - 65536 if bits >= 32768 else bits)
    got = _random_bits16([2, 5], torch.tensor(key))
    assert got.flatten().tolist() == expected[:10]
