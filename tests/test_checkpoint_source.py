"""One checkpoint source: a path located and verified once, its files hashed once, the optimizer state never read.

Two checkpoints of one tiny model: ``combined`` as ``save_checkpoint`` writes it (weights and
Adam moments in one model file) and ``split`` as ``reshard`` writes it (the moments in
``optim-*`` files). The hashes are counted in every process by ``tests/fakes/sitecustomize.py``
(``MEGAFORMER_TEST_HASH_LOG``: one line per sha256 computed, with its process id), also in the
ranks that ``translate --tp 2`` starts.

What "not read" means: an optimizer file is never opened (deleted, or garbage, and decoding
and export work); the moments a ``combined`` model file holds beside the weights go through
its one sha256 and are never deserialised: the file is mapped (``torch.load(mmap=True)``)
and only the weights' tensors are taken.
"""

import collections
import os
import shutil
import subprocess
import sys

import pytest
import torch
from decode_helpers import make_text_checkpoint, one_thread  # noqa: F401
from train_helpers import FAKES, ROOT

from megaformer import checkpoint as ckpt
from megaformer.config import to_dict
from megaformer.errors import CheckpointError
from megaformer.parallel import ParallelContext

STEP = "step-00000010"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("source")
    model = ckpt.load_consolidated(make_text_checkpoint(folder, steps=5)["final"])
    shard = {
        "param": model.model,
        "exp_avg": {k: torch.full_like(v, 0.5) for k, v in model.model.items()},
        "exp_avg_sq": {k: torch.full_like(v, 0.25) for k, v in model.model.items()},
    }
    state = ckpt.CheckpointState(
        shard=shard, run={"engine": {}, "trainer": {"tokens": 7}}, replica={"feed": {}}, rank={"rng": torch.ones(3)}
    )
    meta = {"vocab_size": model.vocab_size, "config": to_dict(model.config), "tokens": 7}
    combined = folder / "combined"
    ckpt.save_checkpoint(
        combined / "checkpoints", 10, ParallelContext.single(), state, meta, keep_last=0, tokenizer=folder / "spm.model"
    )
    split = folder / "split"
    ckpt.reshard(combined / "checkpoints" / STEP, split / "checkpoints", 2, log=lambda m: None)
    (folder / "in.txt").write_text("red cat\nblue dog fish\n")
    return {"combined": combined, "split": split, "input": folder / "in.txt", "model": model}


def _translate_counting(run_dir, tp: int, src, tmp_path) -> tuple[str, dict]:
    """``megaformer translate --ckpt RUN_DIR --tp N`` in a new process; (its output, {(pid, file): hashes})."""
    log = tmp_path / f"hashes-{run_dir.name}-{tp}.log"
    env = {
        **os.environ,
        "PYTHONPATH": f"{FAKES}{os.pathsep}{ROOT}",
        "MEGAFORMER_TEST_HASH_LOG": str(log),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "megaformer.cli", "translate", "--ckpt", str(run_dir), "--tp", str(tp)]
    proc = subprocess.run(
        [*argv, "--input", str(src), "--quiet"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = log.read_text().splitlines() if log.exists() else []
    return proc.stdout, collections.Counter(tuple(line.split(" ", 1)) for line in lines)


@pytest.mark.parametrize(("which", "tp"), [("combined", 1), ("combined", 2), ("split", 2)])
def test_translate_hashes_each_file_once(runs, which, tp, tmp_path):
    """Before the source: 3 sha256 of every model file at tp=1 (choosing the step, resolving it again, reading
    it), 7 at tp=2 (each rank resolved and read the checkpoint again); rank files 2 and 4 times."""
    out, hashes = _translate_counting(runs[which], tp, runs["input"], tmp_path)
    assert out.count("\n") == 2
    step_dir = runs[which] / "checkpoints" / STEP
    wanted = {str(step_dir / name) for name in ckpt.model_names(ckpt.check_complete(step_dir))}
    assert max(hashes.values()) == 1, hashes  # at most once per process
    files = collections.Counter(path for _, path in hashes)
    assert set(files) == wanted and max(files.values()) == 1, files  # once in all: the ranks trust the located source
    assert not any("optim-" in path or "rank-" in path for path in files)
    if tp == 2:
        one, _ = _translate_counting(runs[which], 1, runs["input"], tmp_path)
        assert out == one


@pytest.fixture
def run(run, monkeypatch):
    """conftest's ``run``, with no CUDA device visible."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return run


def test_optimizer_files_are_never_opened(runs, tmp_path, run):
    """Without its optimizer files (deleted, then garbage), a split checkpoint translates and exports as before;
    what needs the moments (reshard, a resume) refuses in one line naming the file."""
    step_dir = tmp_path / "run" / "checkpoints" / STEP
    shutil.copytree(runs["split"], tmp_path / "run")
    optim = sorted(step_dir.glob("optim-*"))
    assert len(optim) == 2 and all(ckpt.safe_torch_load(p).keys() == {"exp_avg", "exp_avg_sq"} for p in optim)
    code, before, err = run("translate", "--ckpt", tmp_path / "run", "--input", runs["input"], "--quiet")
    assert code == 0, err
    for damage in (lambda p: p.unlink(), lambda p: p.write_bytes(b"not a torch file")):
        for p in optim + sorted(step_dir.glob("rank-*")):
            damage(p)
        code, after, err = run("translate", "--ckpt", tmp_path / "run", "--input", runs["input"], "--quiet")
        assert code == 0 and after == before, err
        out = tmp_path / f"export-{len(list(tmp_path.iterdir()))}.safetensors"
        code, _, err = run("export", "--ckpt", step_dir, "--out", out)
        assert code == 0 and out.is_file(), err
        code, _, err = run("reshard", "--ckpt", step_dir, "--out", tmp_path / "again", "--tp", 1)
        assert code != 0 and "optim-tp00-of-02.pt" in err and len(err.strip().splitlines()) == 1, err


def test_moments_of_a_combined_file_are_mapped_not_read(runs, monkeypatch):
    """A model file that holds the moments beside the weights: the file is mapped, the weights alone taken."""
    from megaformer.checkpoint import files

    loads = []
    real = files.torch.load
    monkeypatch.setattr(files.torch, "load", lambda *a, **k: loads.append(k.get("mmap")) or real(*a, **k))
    source = ckpt.locate(runs["combined"], log=print)
    model = ckpt.read_model(source)
    assert loads == [True]  # one load of the one model file, mapped
    assert model.model.keys() == runs["model"].model.keys()
    assert all(torch.equal(model.model[n], t) for n, t in runs["model"].model.items())
    weights = source.weights("model-tp00-of-01.pt")
    assert weights.keys() == {"param"}  # what is handed on: no moments


def test_a_source_is_verified_once_and_handed_on(runs, monkeypatch):
    """The located source's readers hash nothing again; a file changed since it was verified is hashed again,
    and a damaged one refused naming it."""
    from megaformer.checkpoint import format as fmt

    hashed = []
    real = fmt.sha256_of
    monkeypatch.setattr(fmt, "sha256_of", lambda p: hashed.append(p.name) or real(p))
    source = ckpt.locate(runs["split"] / "checkpoints" / "latest", log=print)
    assert source.kind == "step" and source.path.name == STEP and os.fspath(source).endswith("latest")
    assert sorted(hashed) == ["model-tp00-of-02.pt", "model-tp01-of-02.pt", "tokenizer.model"]
    hashed.clear()
    ckpt.read_model(source)
    assert hashed == []
    os.utime(source.path / "tokenizer.model", ns=(1, 1))  # touched: hashed again before it is read
    ckpt.read_model(source)
    assert hashed == ["tokenizer.model"]


def test_every_kind_of_path_is_located(runs, tmp_path):
    step_dir = runs["combined"] / "checkpoints" / STEP
    model_file = tmp_path / "model.pt"
    ckpt.save_consolidated(model_file, runs["model"])
    assert ckpt.locate(model_file, log=print).kind == "model"
    (tmp_path / "x.safetensors").write_bytes(b"")
    assert ckpt.locate(tmp_path / "x.safetensors", log=print).kind == "export"
    for path in (runs["combined"], runs["combined"] / "checkpoints", step_dir, step_dir.parent / "latest"):
        assert ckpt.locate(path, log=print).path == step_dir
    with pytest.raises(CheckpointError, match="no such checkpoint or model file"):
        ckpt.locate(tmp_path / "missing", log=print)
    with pytest.raises(CheckpointError, match="holds no training state"):
        ckpt.locate(model_file, log=print, everything=True)
