"""Outputs never destroy inputs; absurd values and damaged records are one line.

The tables follow ``tests/test_cli_inputs.py``: one row per case, run through
``megaformer.cli.main`` as a user runs it, and each must end in ONE line on stderr that
holds the row's fragment, a non-zero status and no traceback, with every file of the
inputs byte for byte as before (their sha256 is taken before and after every row).

* ``DESTROY``: outputs that would write into or over what the command reads, ``--force``
  over something the command did not make, a name that says another format or step.
* ``ABSURD``: finite values that overflow a library (or a cluster), and launch variables.
* ``DAMAGED``: hand-edited meta.json, export manifests and safetensors headers whose
  fields have the wrong kind.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, tree_digest
from decode_helpers import make_text_checkpoint, one_thread, random_sentence, reverse_sentence  # noqa: F401

from megaformer import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SLURM = ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Everything the rows read: a model file, a run with step 20, its test set, a corpus, exports, someone's folder."""
    from megaformer.checkpoint import CheckpointState, load_consolidated, save_checkpoint
    from megaformer.config import to_dict
    from megaformer.parallel import ParallelContext

    root = tmp_path_factory.mktemp("world")
    model_path = make_text_checkpoint(root, steps=2)["final"]
    model = load_consolidated(model_path)
    state = CheckpointState(
        shard={"param": model.model, "exp_avg": model.model, "exp_avg_sq": model.model},
        run={"engine": {}, "trainer": {"tokens": 0}},
        replica={},
        rank={},
    )
    meta = {"config": to_dict(model.config), "vocab_size": model.vocab_size, "tokens": 0}
    step = save_checkpoint(
        root / "run" / "checkpoints", 20, ParallelContext.single(), state, meta, 5, root / "spm.model"
    )
    rng = random.Random(4)
    src = [random_sentence(rng) for _ in range(4)]
    (root / "test.src").write_text("\n".join(src) + "\n")
    (root / "test.ref").write_text("\n".join(reverse_sentence(x) for x in src) + "\n")
    (root / "corpus").mkdir()
    for lang in ("xx", "yy"):
        (root / "corpus" / f"train.{lang}").write_text("a b\nc d\n")
    (root / "own").mkdir()
    (root / "own" / "keep.txt").write_text("someone's file\n")
    (root / "sub").mkdir()
    (root / "sub" / "keep.txt").write_text("so that sub is not empty\n")
    exports = root / "exports"
    for name, fmt in (("sdir", "safetensors"), ("hf", "hf"), ("m.safetensors", "safetensors")):
        code = cli.main(["export", "--ckpt", str(model_path), "--out", str(exports / name), "--format", fmt])
        assert code == 0
    paths = {"root": root, "model": model_path, "step": step, "run": root / "run", "latest": step.parent / "latest"}
    paths.update(src=root / "test.src", ref=root / "test.ref", corpus=root / "corpus", own=root / "own")
    paths.update(sub=root / "sub", sdir=exports / "sdir", hf=exports / "hf", file=exports / "m.safetensors")
    return paths


def expand(argv: tuple, paths: dict) -> list[str]:
    return [str(a).format(**{k: str(v) for k, v in paths.items()}) for a in argv]


def _case_id(row) -> str:
    return " ".join(str(a).replace("{", "").replace("}", "") for a in row[0])[:90]


def run_row(run, world, monkeypatch, argv: tuple, fragment: str, cwd: str = "", env: dict | None = None) -> None:
    """One row: in ``world[cwd]`` with ``env`` set (and no launch variables else), the inputs unchanged."""
    from launcher.env import LAUNCH_VARIABLES

    for name in (*LAUNCH_VARIABLES, *SLURM):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    if cwd:
        monkeypatch.chdir(world[cwd])
    before = tree_digest(world["root"])
    code, _, err = run(*expand(argv, world))
    assert_one_line_error(code, err, fragment)
    assert tree_digest(world["root"]) == before


# ---- A. outputs that destroy inputs -------------------------------------------------------------------

TRANSLATE = ("translate", "--ckpt", "{model}", "--input", "{src}", "--quiet")
EVALUATE = ("evaluate", "--ckpt", "{model}", "--input", "{src}", "--ref", "{ref}", "--quiet")
EXPORT = ("export", "--ckpt", "{model}")

DESTROY = [
    # 1. an export over the input checkpoint's own shard, or anywhere inside (or above) what is read
    (("export", "--ckpt", "{step}", "--force", "--out", "{step}/model-tp00-of-01.pt"), "is inside the input", {}),
    (("export", "--ckpt", "{run}", "--out", "{step}/model.safetensors"), "is inside the input", {}),
    (("export", "--ckpt", "{run}", "--force", "--out", "{latest}"), "'latest' is a name training's saves", {}),
    (("export", "--ckpt", "{step}", "--format", "hf", "--force", "--out", "{run}"), "holds the input", {}),
    # 2. translations or hypotheses over the source, the references or the model
    (TRANSLATE + ("--output", "{src}"), "it is the --input file", {}),
    (TRANSLATE + ("--output", "{model}"), "it is the checkpoint", {}),
    (
        ("translate", "--ckpt", "{run}", "--input", "{src}", "--output", "{step}/hyp.txt"),
        "is inside the checkpoint",
        {},
    ),
    (EVALUATE + ("--output", "{ref}"), "it is the --ref file", {}),
    (EVALUATE + ("--output", "{model}"), "it is the checkpoint", {}),
    # 3. prepare --force over the working directory, a folder above it or an input, or someone's folder
    (("prepare", "--synthetic", "20", "--out", ".", "--force", "--quiet"), "is the working directory", {"cwd": "root"}),
    (
        ("prepare", "--synthetic", "20", "--out", "..", "--force", "--quiet"),
        "a folder above the working",
        {"cwd": "sub"},
    ),
    (("prepare", "--synthetic", "20", "--out", "{own}", "--force", "--quiet"), "no manifest.json of megaformer", {}),
    (
        ("prepare", "--src", "xx", "--tgt", "yy", "--train", "{corpus}/train", "--out", "{corpus}", "--force"),
        "holds the input --train",
        {},
    ),
    # 4. a file name that says another format than the one written
    (EXPORT + ("--format", "pt", "--out", "{root}/x.safetensors"), "--format pt writes one megaformer model file", {}),
    (EXPORT + ("--format", "safetensors", "--out", "{root}/x.pt"), "not a .pt file", {}),
    (EXPORT + ("--format", "hf", "--out", "{root}/x.safetensors"), "writes a directory", {}),
    (EXPORT + ("--out", "{root}/model.txt"), "a .txt name says another kind of file", {}),
    (EXPORT + ("--format", "ct2", "--out", "{root}/model.pth"), "writes a directory", {}),
    (EXPORT + ("--force", "--out", "{own}"), "a folder that this command did not write", {}),
    # 5. a step directory name that says another step than the one written
    (
        ("reshard", "--ckpt", "{step}", "--out", "{run}/checkpoints/step-99999999", "--tp", "1"),
        "says step 99999999",
        {},
    ),
    (("average", "--ckpt", "{step}", "--out", "{run}/checkpoints/step-00000099"), "name it NAME.pt", {}),
    # 6. an export folder that cannot be written
    (EXPORT + ("--out", "."), "is the working directory", {"cwd": "sub"}),
    (EXPORT + ("--force", "--out", "."), "is the working directory", {"cwd": "sub"}),
    (EXPORT + ("--out", "/proc/megaformer-export"), "takes no new files (a special file system", {}),
    (EXPORT + ("--out", "/proc/megaformer.safetensors"), "takes no new files (a special file system", {}),
]


@pytest.mark.parametrize("argv, fragment, where", DESTROY, ids=[_case_id(r) for r in DESTROY])
def test_outputs_never_destroy_inputs(argv, fragment, where, run, world, monkeypatch):
    if "/proc/" in " ".join(argv) and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc, a folder nobody can create files in")
    run_row(run, world, monkeypatch, argv, fragment, **where)


def test_force_replaces_what_the_command_made(run, world, tmp_path):
    """The other side of the table: an earlier export or prepare, an empty folder, a run directory's top."""
    before = tree_digest(world["root"])
    for name in ("m.safetensors", "m.pt", "mdir", "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        argv = ("export", "--ckpt", world["model"], "--out", tmp_path / name)
        if name != "empty":
            assert run(*argv)[0] == 0
            assert_one_line_error(*run(*argv)[::2], "pass --force")
        code, _, err = run(*argv, "--force")
        assert code == 0, err
    assert run("prepare", "--synthetic", "30", "--out", tmp_path / "data", "--quiet")[0] == 0
    assert run("prepare", "--synthetic", "30", "--out", tmp_path / "data", "--force", "--quiet")[0] == 0
    code, _, err = run("reshard", "--ckpt", world["step"], "--out", tmp_path / "tp1" / "step-00000020", "--tp", "1")
    assert code == 0, err
    copy = tmp_path / "run"
    shutil.copytree(world["run"], copy)
    code, _, err = run("export", "--ckpt", copy, "--out", copy / "model.safetensors")  # beside the checkpoints
    assert code == 0, err
    assert tree_digest(world["root"]) == before


# ---- B. finite but absurd values, launch variables --------------------------------------------------

ABSURD = [
    (TRANSLATE + ("--max-len-a", "1e300"), "argument --max-len-a: must be in [0.0, 1000.0]", {}),
    (EVALUATE + ("--max-len-a", "1e300"), "argument --max-len-a: must be in", {}),
    (TRANSLATE + ("--max-len-b", "99999999999999999999"), "argument --max-len-b: must be at most 1000000", {}),
    (EVALUATE + ("--max-len-b", "99999999999999999999"), "argument --max-len-b", {}),
    (("info", "--config", TINY, "--set", "parallel.timeout_minutes=1e13"), "parallel.timeout_minutes=", {}),
    (("train", "--config", TINY, "--set", "parallel.timeout_minutes=1e13"), "must be in (0, 10080]", {}),
    (("parity", "--config", TINY, "--tp", "2", "--set", "parallel.timeout_minutes=1e13"), "timeout_minutes", {}),
    (
        ("info", "--config", TINY, "--set", "model.max_positions=10"),
        "model.max_positions=10 is below data.max_len=64",
        {},
    ),
    (("train", "--config", TINY, "--set", "model.max_positions=64"), "raise model.max_positions to at least 65", {}),
    (("info", "--config", TINY, "--set", "model.d_model=4000000000"), "model.d_model=4000000000: the attention", {}),
    (("info", "--config", TINY, "--set", "data.vocab_size=1e13"), "lower data.vocab_size or model.d_model", {}),
    (("info", "--config", TINY, "--set", "decode.max_len_b=1e20"), "decode.max_len_b=", {}),
    (
        ("train", "--config", TINY, "--run-dir", "{root}/train-run"),
        "MASTER_PORT=99999 is not a TCP port",
        {"env": {"MASTER_PORT": "99999"}},
    ),
    (
        ("parity", "--config", TINY, "--tp", "2"),
        "MASTER_PORT=99999 is not a TCP port",
        {"env": {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}},
    ),
    (
        ("train", "--config", TINY, "--run-dir", "{root}/train-run"),
        "names 100,000,000 hosts, more than any cluster",
        {"env": {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n[0-99999999]"}},
    ),
]


@pytest.mark.parametrize("argv, fragment, where", ABSURD, ids=[_case_id(r) for r in ABSURD])
def test_absurd_values_are_refused_in_one_line(argv, fragment, where, run, world, monkeypatch):
    run_row(run, world, monkeypatch, argv, fragment, **where)


@pytest.mark.parametrize("tokenize", ["ja-mecab", "ko-mecab", "flores101", "spm"])
def test_a_tokenizer_that_cannot_be_built_is_refused_before_decoding(tokenize, run, world, monkeypatch):
    """MeCab missing, or a sentencepiece model to download where there is no network: refused before decoding."""
    import urllib.error

    from megaformer.commands import evaluate as evaluate_command

    if "mecab" in tokenize:
        try:
            evaluate_command.BLEU(tokenize=tokenize)
            pytest.skip(f"{tokenize} can be built here")
        except Exception:
            pass
    else:  # never download in a test: the download fails as it does without a network

        class Offline:
            TOKENIZERS = evaluate_command.BLEU.TOKENIZERS

            def __init__(self, tokenize: str = "13a", **_) -> None:
                raise urllib.error.URLError("[Errno -2] Name or service not known")

        monkeypatch.setattr(evaluate_command, "BLEU", Offline)
    monkeypatch.setattr(evaluate_command, "translate_text", lambda *a, **k: pytest.fail("decoded before the check"))
    run_row(run, world, monkeypatch, EVALUATE + ("--tokenize", tokenize), f"--tokenize {tokenize}: sacreBLEU cannot")


def test_host_lists_are_counted_before_they_are_expanded():
    from launcher.env import MAX_HOSTS, host_count, parse_hostlist
    from megaformer.errors import ConfigError

    assert host_count("gpu[01-03,07],login1") == 5 and host_count("rack[1-2]-node[01-04]") == 8
    assert parse_hostlist("n[098-101]") == ["n098", "n099", "n100", "n101"]
    started = time.monotonic()
    with pytest.raises(ConfigError, match="more than any cluster"):
        parse_hostlist(f"n[1-{MAX_HOSTS}],m[0-9]x[0-9]")
    assert time.monotonic() - started < 1.0


def _scan_split(model, pp: int, vocab_size: int) -> list[int]:
    """The cut as it was computed before: every (k, i, j), ties to the smaller j."""
    from megaformer.parallel.stages import layer_costs

    enc, dec, head = layer_costs(model, vocab_size)
    costs = [enc] * model.encoder_layers + [dec] * model.decoder_layers
    n, prefix = len(costs), [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[float("inf")] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j] + (head if k == pp else 0.0))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(pp, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def test_the_fast_pipeline_cut_is_the_scan_and_quick():
    from megaformer.config import ModelConfig
    from megaformer.parallel.stages import balanced_split

    rng = random.Random(0)
    for _ in range(300):
        e, d = rng.randint(1, 16), rng.randint(1, 16)
        model = ModelConfig(
            d_model=rng.choice([8, 64, 512]), d_ff=rng.choice([4, 2048]), encoder_layers=e, decoder_layers=d
        )
        pp, vocab = rng.randint(1, e + d), rng.choice([4, 8000, 37000])
        assert balanced_split(model, pp, vocab) == _scan_split(model, pp, vocab), (model, pp, vocab)
    started = time.monotonic()
    counts = balanced_split(ModelConfig(encoder_layers=2000, decoder_layers=2000), 2000, 8000)
    assert len(counts) == 2000 and sum(counts) == 4000 and time.monotonic() - started < 20


def test_info_of_a_thousand_stages_answers(run):
    sets = ["model.encoder_layers=1000", "model.decoder_layers=1000", "parallel.pp=1000"]
    started = time.monotonic()
    code, out, err = run("info", "--config", TINY, "--json", *[x for s in sets for x in ("--set", s)])
    assert code == 0, err
    stages = json.loads(out)["pipeline"]["stages"]
    assert len(stages) == 1000 and sum(s["parameters"] for s in stages) == json.loads(out)["parameters"]
    assert time.monotonic() - started < 120


# ---- B. damaged records: meta.json, export manifests, safetensors headers ----------------------------

DAMAGED = [
    ("step", "meta.json", ("files",), [], "meta.json: files is [], expected dict"),
    ("step", "meta.json", ("files", "model-tp00-of-01.pt", "bytes"), "9", "files.model-tp00-of-01.pt.bytes is '9'"),
    ("step", "meta.json", ("files", "model-tp00-of-01.pt", "sha256"), None, "files.model-tp00-of-01.pt.sha256"),
    ("step", "meta.json", ("layout", "tp"), 0, "meta.json: layout.tp is 0, expected int >= 1"),
    ("step", "meta.json", ("layout",), "tp=1", "meta.json: layout is 'tp=1', expected dict"),
    ("step", "meta.json", ("run", "trainer"), 3, "meta.json: run.trainer is 3"),
    ("step", "meta.json", ("config", "model"), 7, "meta.json: config.model is 7, expected dict"),
    ("step", "meta.json", ("vocab_size",), "60", "meta.json: vocab_size is '60'"),
    ("step", "meta.json", ("replicas",), {}, "meta.json: replicas is {}, expected list"),
    ("step", "meta.json", ("step",), "20", "meta.json: step '20' is not a step count"),
    ("sdir", "megaformer-export.json", ("files",), [], "megaformer-export.json: field 'files' is a list"),
    ("sdir", "megaformer-export.json", ("files", "model.safetensors"), "x", "field 'files.model.safetensors' is a"),
    ("sdir", "megaformer-export.json", ("files", "model.safetensors", "bytes"), "12", "expected an integer"),
    ("sdir", "megaformer-export.json", ("format",), 5, "field 'format' is an integer 5, expected a string"),
    ("hf", "megaformer-export.json", ("config",), "x", "megaformer-export.json: field 'config' is a string"),
    ("hf", "megaformer-export.json", ("vocab_size",), "60", "field 'vocab_size' is a string '60'"),
    ("hf", "megaformer-export.json", ("meta",), [], "field 'meta' is a list"),
    ("hf", "megaformer-export.json", ("config", "model", "d_model"), "big", "field 'config': model.d_model"),
    ("file", "", ("config",), "[1]", "m.safetensors: field 'config' is a list"),
    ("file", "", ("config",), "{bad", "header field 'config' is not JSON"),
    ("file", "", ("vocab_size",), "x", "header field 'vocab_size' is 'x'"),
    ("file", "", ("meta",), "[]", "field 'meta' is a list"),
    ("file", "", ("tokenizer",), "@@@", "header field 'tokenizer' is not base64"),
]


def _edit(copy: Path, record: str, keys: tuple, value) -> None:
    """Set ``keys`` to ``value`` in the JSON ``record`` of ``copy`` (or in the safetensors header of the file)."""
    if not record:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(copy), framework="pt") as f:
            header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(copy), metadata={**header, keys[0]: value})
        return
    path = copy / record
    data = json.loads(path.read_text())
    target = data
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "what, record, keys, value, fragment", DAMAGED, ids=[f"{r[0]}-{'.'.join(r[2])}" for r in DAMAGED]
)
def test_hand_edited_records_are_one_line_naming_file_and_field(
    what, record, keys, value, fragment, run, world, tmp_path
):
    copy = tmp_path / world[what].name
    (shutil.copytree if world[what].is_dir() else shutil.copyfile)(world[what], copy)
    _edit(copy, record, keys, value)
    before = tree_digest(tmp_path)
    code, _, err = run("translate", "--ckpt", copy, "--input", world["src"], "--beam", "1", "--quiet")
    assert_one_line_error(code, err, fragment)
    assert str(copy) in err
    assert tree_digest(tmp_path) == before
