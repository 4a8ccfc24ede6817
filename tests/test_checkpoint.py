"""The checkpoint module on its own: states placed and read back, checksums, hostile files, nothing destroyed.

Step directories are written through :func:`save_checkpoint` in one process; the
commands that read checkpoints run as a user calls them (``megaformer.cli.main``).
Training end to end (kill -9, resume at other layouts) is in test_train.py.
"""

import json
import os
import pickle
import shutil

import pytest
import torch
from decode_helpers import make_text_checkpoint, one_thread  # noqa: F401

from megaformer import checkpoint as ckpt
from megaformer import cli
from megaformer.errors import CheckpointError
from megaformer.parallel import ParallelContext


def _write_step(root, step: int, model: ckpt.Consolidated, tokenizer) -> "os.PathLike":
    from megaformer.config import to_dict

    shard = {
        "param": {k: v.clone() for k, v in model.model.items()},
        "exp_avg": {k: torch.full_like(v, 0.5) for k, v in model.model.items()},
        "exp_avg_sq": {k: torch.full_like(v, 0.25) for k, v in model.model.items()},
    }
    state = ckpt.CheckpointState(
        shard=shard,
        run={"engine": {"global_steps": step, "skipped_steps": 0, "optimizer_steps": step}, "trainer": {"tokens": 7}},
        replica={"feed": {"streams": 1}},
        rank={"torch_rng": torch.get_rng_state()},
    )
    meta = {"vocab_size": model.vocab_size, "config": to_dict(model.config), "tokens": 7}
    return ckpt.save_checkpoint(root, step, ParallelContext.single(), state, meta, keep_last=0, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    paths = make_text_checkpoint(folder, steps=5)
    model = ckpt.load_consolidated(paths["final"])
    tokenizer = folder / "spm.model"
    run = folder / "run"
    for step in (10, 20):
        _write_step(run / "checkpoints", step, model, tokenizer)
    (folder / "test.src").write_text("red cat\nblue dog\n")
    return run


@pytest.fixture
def run(capsys):
    def call(*argv):
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return call


def _copy_run(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def _damage(path) -> None:
    """Flip bytes in the middle of ``path``: same size, other content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def test_states_are_placed_and_read_back(run_dir):
    step_dir = run_dir / "checkpoints" / "step-00000020"
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["run"]["trainer"] == {"tokens": 7} and meta["replicas"] == [{"feed": {"streams": 1}}]
    assert all(len(e["sha256"]) == 64 and e["bytes"] > 0 for e in meta["files"].values())
    from megaformer.config import from_dict
    from megaformer.model import shape_model

    model = shape_model(from_dict(meta["config"]), meta["vocab_size"])
    loaded = ckpt.load_checkpoint(step_dir, ParallelContext.single(), model)
    assert set(loaded.shard["param"]) == {n for n, _ in model.named_parameters()}
    assert all(torch.all(t == 0.5) for t in loaded.shard["exp_avg"].values())
    assert loaded.rank is not None and loaded.replica_at(0, 0) == {"feed": {"streams": 1}}
    assert loaded.replica_at(1, 0) is None


def test_damaged_newest_is_skipped_and_said(run_dir, tmp_path):
    run_copy = _copy_run(run_dir, tmp_path)
    _damage(run_copy / "checkpoints" / "step-00000020" / "model-tp00-of-01.pt")
    said = []
    assert ckpt.find_latest(run_copy, said.append).name == "step-00000010"
    assert any("model-tp00-of-01.pt" in s and "sha256" in s for s in said)
    assert any("using the older checkpoint step-00000010" in s for s in said)


@pytest.mark.parametrize("command", ["translate", "evaluate", "export", "average", "reshard"])
def test_damaged_weights_are_refused_by_every_reader(run_dir, tmp_path, run, command):
    """A same-size damaged model file named explicitly: a one-line error naming it, no traceback."""
    run_copy = _copy_run(run_dir, tmp_path)
    step_dir = run_copy / "checkpoints" / "step-00000020"
    _damage(step_dir / "model-tp00-of-01.pt")
    code, _, err = run(*_reader_args(command, step_dir, run_dir.parent, tmp_path))
    assert code != 0
    assert "model-tp00-of-01.pt" in err and "Traceback" not in err, err


def _reader_args(command: str, step_dir, data_dir, tmp_path) -> list:
    src = data_dir / "test.src"
    return {
        "translate": ["translate", "--ckpt", step_dir, "--input", src, "--quiet"],
        "evaluate": ["evaluate", "--ckpt", step_dir, "--input", src, "--ref", src, "--quiet"],
        "export": ["export", "--ckpt", step_dir, "--out", tmp_path / "exported.pt"],
        "average": ["average", "--ckpt", step_dir.parent / "step-00000010", step_dir, "--out", tmp_path / "avg.pt"],
        "reshard": ["reshard", "--ckpt", step_dir, "--out", tmp_path / "resharded", "--tp", "2"],
    }[command]


class _Payload:
    """Unpickling this runs a command: what a hostile checkpoint would do."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("command", ["translate", "evaluate", "export", "average", "reshard"])
def test_hostile_pickle_is_refused_and_runs_nothing(run_dir, tmp_path, run, command):
    """A model file whose unpickling would run code, with a matching checksum: refused, nothing runs."""
    run_copy = _copy_run(run_dir, tmp_path)
    step_dir = run_copy / "checkpoints" / "step-00000020"
    marker = tmp_path / "pwned"
    hostile = step_dir / "model-tp00-of-01.pt"
    torch.save({"param": _Payload(marker)}, hostile, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"][hostile.name] = {"bytes": hostile.stat().st_size, "sha256": ckpt.sha256_of(hostile)}
    (step_dir / "meta.json").write_text(json.dumps(meta))
    code, _, err = run(*_reader_args(command, step_dir, run_dir.parent, tmp_path))
    assert code != 0 and not marker.exists()
    assert hostile.name in err and "Traceback" not in err, err


def test_hostile_consolidated_file_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    torch.save({"format": ckpt.CONSOLIDATED_FORMAT, "model": _Payload(marker)}, path)
    with pytest.raises(CheckpointError, match="model.pt"):
        ckpt.load_consolidated(path)
    assert not marker.exists()


def test_damaged_consolidated_file_is_refused(run_dir, tmp_path):
    model = ckpt.consolidate(run_dir / "checkpoints" / "step-00000020")
    path = tmp_path / "model.pt"
    ckpt.save_consolidated(path, model)
    _damage(path)
    with pytest.raises(CheckpointError, match="model.pt"):
        ckpt.load_consolidated(path)


def test_non_finite_model_is_never_saved(run_dir, tmp_path):
    model = ckpt.consolidate(run_dir / "checkpoints" / "step-00000020")
    name = next(iter(model.model))
    model.model[name][0] = float("nan")
    with pytest.raises(CheckpointError, match="inf or NaN"):
        _write_step(tmp_path / "checkpoints", 30, model, None)
    assert not (tmp_path / "checkpoints" / "step-00000030").exists()
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_meta_missing_a_key_is_one_line(run_dir, tmp_path, run):
    run_copy = _copy_run(run_dir, tmp_path)
    step_dir = run_copy / "checkpoints" / "step-00000020"
    meta = json.loads((step_dir / "meta.json").read_text())
    del meta["layout"]
    (step_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="lacks layout"):
        ckpt.check_complete(step_dir)
    code, _, err = run("export", "--ckpt", step_dir, "--out", tmp_path / "x.pt")
    assert code != 0 and "lacks layout" in err and "Traceback" not in err


def _tree_bytes(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_reshard_never_writes_over_its_input(run_dir, tmp_path):
    run_copy = _copy_run(run_dir, tmp_path)
    root = run_copy / "checkpoints"
    before = _tree_bytes(root)
    for out in (root, root / "step-00000020", root / "step-00000010"):
        with pytest.raises(CheckpointError):
            ckpt.reshard(root / "step-00000020", out, 2, log=lambda m: None)
    assert _tree_bytes(root) == before  # byte for byte
    for bad_tp in (0, -2, True):
        with pytest.raises(CheckpointError):
            ckpt.reshard(root / "step-00000020", tmp_path / "elsewhere", bad_tp, log=lambda m: None)
    assert _tree_bytes(root) == before


def test_reshard_round_trip_is_bitwise(run_dir, tmp_path):
    src = run_dir / "checkpoints" / "step-00000020"
    two = ckpt.reshard(src, tmp_path / "tp2", 2, log=lambda m: None)
    one = ckpt.reshard(two, tmp_path / "tp1", 1, log=lambda m: None)
    a, b = ckpt.consolidate(src), ckpt.consolidate(one)
    assert a.model.keys() == b.model.keys()
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert json.loads((two / "meta.json").read_text())["layout"]["tp"] == 2
