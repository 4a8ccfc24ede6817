"""Commands never destroy what they read or what is not theirs, and never fall back in silence.

Outputs over inputs, ``--force`` over someone's files, names a run's checkpoints own, a
file system's refusal; a damaged checkpoint announced, not skipped without a word. The
commands run through ``megaformer.cli.main`` as a user calls them (the ``run`` fixture),
over a small trained model and a run directory holding it (``text_run``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, tree_digest
from decode_helpers import make_text_checkpoint, one_thread, random_sentence, reverse_sentence  # noqa: F401

from megaformer.config import to_dict

ROOT = Path(__file__).resolve().parents[1]

# ---- nothing destroyed ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A consolidated model with its tokenizer, and a run directory holding it at steps 700 and 800 (TP=1)."""
    from megaformer.checkpoint import CheckpointState, load_consolidated, save_checkpoint
    from megaformer.parallel import ParallelContext

    folder = tmp_path_factory.mktemp("text_run")
    model_path = make_text_checkpoint(folder, steps=2)["final"]
    model = load_consolidated(model_path)
    (folder / "spm.model").write_bytes(model.tokenizer)
    for step in (700, 800):
        save_checkpoint(
            folder / "run" / "checkpoints",
            step,
            ParallelContext.single(),
            CheckpointState(
                shard={"param": model.model, "exp_avg": model.model, "exp_avg_sq": model.model},
                run={"engine": {}, "trainer": {"tokens": 0}},
                replica={},
                rank={},
            ),
            {"config": to_dict(model.config), "vocab_size": model.vocab_size, "tokens": 0},
            keep_last=10,
            tokenizer=folder / "spm.model",
        )
    rng = random.Random(4)
    src = [random_sentence(rng) for _ in range(4)]
    (folder / "test.src").write_text("\n".join(src) + "\n")
    (folder / "test.ref").write_text("\n".join(reverse_sentence(x) for x in src) + "\n")
    return {"model": model_path, "run": folder / "run", "src": folder / "test.src", "ref": folder / "test.ref"}


def test_reshard_into_its_own_folder_is_refused_and_leaves_the_checkpoint_intact(text_run, run, tmp_path):
    """The issue's reproduction (--tp -2, output over the input), then the same with a valid --tp."""
    step = text_run["run"] / "checkpoints" / "step-00000800"
    before = tree_digest(text_run["run"])
    for tp, fragment in (("-2", "argument --tp"), ("0", "argument --tp"), ("1", "would replace the input")):
        code, _, err = run("reshard", "--ckpt", step, "--out", text_run["run"] / "checkpoints", "--tp", tp)
        assert_one_line_error(code, err, fragment)
    assert_one_line_error(*run("reshard", "--ckpt", step, "--out", step, "--tp", "1")[::2], "would replace the input")
    assert_one_line_error(*run("reshard", "--ckpt", step, "--out", step / "x", "--tp", "1")[::2], "inside the input")
    assert tree_digest(text_run["run"]) == before

    out = tmp_path / "tp2"
    code, text, err = run("reshard", "--ckpt", step, "--out", out, "--tp", "2")
    assert code == 0, err
    assert "tp=2" in text and (out / "step-00000800" / "model-tp01-of-02.pt").is_file()
    written = tree_digest(out)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left behind
    assert_one_line_error(*run("reshard", "--ckpt", step, "--out", out, "--tp", "2")[::2], "already exists")
    assert tree_digest(out) == written and tree_digest(text_run["run"]) == before


def test_average_and_evaluate_refuse_to_overwrite_their_inputs(text_run, run):
    step = text_run["run"] / "checkpoints" / "step-00000800"
    before = tree_digest(text_run["run"]), text_run["model"].read_bytes(), text_run["ref"].read_bytes()
    assert_one_line_error(
        *run("average", "--ckpt", step, text_run["model"], "--out", step / "avg.pt")[::2], "would overwrite the input"
    )
    assert_one_line_error(
        *run("average", "--ckpt", step, text_run["model"], "--out", text_run["model"])[::2], "would overwrite"
    )
    argv = ("evaluate", "--ckpt", text_run["model"], "--input", text_run["src"], "--ref", text_run["ref"])
    assert_one_line_error(*run(*argv, "--output", text_run["ref"])[::2], "is the --ref file")
    assert (tree_digest(text_run["run"]), text_run["model"].read_bytes(), text_run["ref"].read_bytes()) == before


def test_average_and_export_keep_off_what_a_run_reads_and_what_is_not_theirs(text_run, run, tmp_path):
    """average wrote over the newest step of a run named by --ckpt RUN, over its `latest` pointer, over any file
    and under any suffix; export took a step-N name among a run's checkpoints, which training's save replaced."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(text_run["run"], copy)
    (copy / ".lock").unlink(missing_ok=True)
    step = copy / "checkpoints" / "step-00000800"
    before = tree_digest(copy)
    shard = step / "model-tp00-of-01.pt"
    assert_one_line_error(*run("average", "--ckpt", copy, "--out", shard)[::2], "is inside the input")
    assert_one_line_error(*run("average", "--ckpt", copy, "--out", tmp_path / "a.safetensors")[::2], "name it NAME.pt")
    latest_out = copy / "checkpoints" / "latest"
    assert_one_line_error(*run("average", "--run-dir", copy, "--last", "1", "--out", latest_out)[::2], "NAME.pt")
    assert_one_line_error(
        *run("export", "--ckpt", copy, "--format", "hf", "--out", copy / "checkpoints" / "step-00000900")[::2],
        "holds a run's checkpoints, and 'step-00000900' is a name training",
    )
    assert tree_digest(copy) == before and (copy / "checkpoints" / "latest").read_text().strip() == "step-00000800"
    notes = tmp_path / "notes.pt"
    notes.write_text("my notes\n")
    assert_one_line_error(*run("average", "--ckpt", copy, "--out", notes)[::2], "already exists")
    assert_one_line_error(*run("average", "--ckpt", copy, "--out", notes, "--force")[::2], "no megaformer model")
    assert notes.read_text() == "my notes\n"
    out = copy / "averaged.pt"  # beside the run's checkpoints: fine, and an earlier average is replaced with --force
    assert run("average", "--ckpt", copy, "--out", out)[0] == 0
    assert_one_line_error(*run("average", "--ckpt", copy, "--out", out)[::2], "already exists")
    assert run("average", "--ckpt", copy, "--out", out, "--force")[0] == 0


def test_checkpoint_tools_say_what_was_given_and_what_to_give(text_run, run, tmp_path):
    """Messages that named the wrong cause or a fix that did not work, and an output nothing would read."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(text_run["run"], copy)
    step = copy / "checkpoints" / "step-00000800"
    # a model file is no training checkpoint (it said "no complete checkpoint found")
    argv = ("reshard", "--ckpt", text_run["model"], "--out", tmp_path / "r", "--tp", "2")
    assert_one_line_error(*run(*argv)[::2], "is a file, not a training checkpoint")
    assert "`translate --tp N` decodes it" in run(*argv)[2]
    # a pointer to a deleted step (it said "no meta.json (the save did not finish)")
    (copy / "checkpoints" / "best").write_text("step-00000010\n")
    argv = ("translate", "--ckpt", copy / "checkpoints" / "best", "--input", text_run["src"])
    assert_one_line_error(*run(*argv)[::2], "best: names step-00000010, which is not in")
    # average --run-dir of one step suggested --last 1, which failed the same way
    argv = ("average", "--run-dir", step, "--out", tmp_path / "a.pt")
    assert_one_line_error(*run(*argv)[::2], "is one checkpoint (a step directory), not a run: name the checkpoints")
    # reshard into a run directory wrote a step beside checkpoints/, which nothing reads
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    argv = ("reshard", "--ckpt", step, "--out", other, "--tp", "2")
    assert_one_line_error(
        *run(*argv)[::2], f"is a run directory, whose checkpoints are read from {other / 'checkpoints'}"
    )
    assert list(other.iterdir()) == [other / "checkpoints"]
    # an export of an average says so, and names the file it read (it named the newest step's directory)
    code, _, err = run("average", "--ckpt", step, text_run["model"], "--out", tmp_path / "avg.pt")
    assert code == 0, err
    code, out, err = run("export", "--ckpt", tmp_path / "avg.pt", "--out", tmp_path / "avg.safetensors")
    assert code == 0, err
    assert "the average of steps [" in out and out.rstrip().endswith(f"from {tmp_path / 'avg.pt'}"), out


def test_prepare_refuses_to_replace_a_folder_holding_its_input(run, tmp_path):
    (tmp_path / "corpus").mkdir()
    for lang in ("xx", "yy"):
        (tmp_path / "corpus" / f"train.{lang}").write_text("a b\n")
    before = tree_digest(tmp_path / "corpus")
    argv = ("prepare", "--src", "xx", "--tgt", "yy", "--train", tmp_path / "corpus" / "train")
    code, _, err = run(*argv, "--out", tmp_path / "corpus", "--force", "--quiet")
    assert_one_line_error(code, err, "holds the input --train")
    assert tree_digest(tmp_path / "corpus") == before


def test_force_replaces_an_earlier_output_only_while_it_holds_nothing_else(text_run, run, tmp_path):
    """``prepare --force`` and ``export --force`` deleted a folder the user had put in their earlier output."""
    out = tmp_path / "data"
    argv = ("prepare", "--synthetic", "60", "--out", out, "--quiet")
    assert run(*argv)[0] == 0
    (out / "my-notes").mkdir()
    (out / "my-notes" / "plan.txt").write_text("keep me\n")
    before = tree_digest(out)
    assert_one_line_error(*run(*argv, "--force")[::2], "also holds my-notes/, which this command did not write")
    assert tree_digest(out) == before
    (out / "my-notes" / "plan.txt").unlink()
    (out / "my-notes").rmdir()
    assert run(*argv, "--force")[0] == 0  # its own output alone: replaced

    export = tmp_path / "hf"
    argv = ("export", "--ckpt", text_run["model"], "--format", "safetensors", "--out", export)
    assert run(*argv)[0] == 0, run(*argv)[2]
    (export / "README.md").write_text("my model card\n")
    assert_one_line_error(*run(*argv, "--force")[::2], "also holds README.md, which this command did not write")
    assert (export / "README.md").read_text() == "my model card\n"


@pytest.mark.parametrize(
    "error, said",
    [
        (OSError(28, "No space left on device"), "error: writing {out}: No space left on device: free space there"),
        (OSError(30, "Read-only file system", "/mnt/ro/x"), "error: /mnt/ro/x: Read-only file system: write to"),
    ],
)
def test_a_file_system_refusal_is_one_line(run, tmp_path, monkeypatch, error, said):
    """A full disk or a read-only folder ended prepare (and train's run lock) in a traceback."""
    import megaformer.commands.prepare as prepare

    def refused(*args, **kwargs):
        raise error

    monkeypatch.setattr(prepare, "prepare", refused)
    out = tmp_path / "out"
    assert_one_line_error(*run("prepare", "--synthetic", "10", "--out", out)[::2], said.format(out=out))


def test_a_bug_of_ours_keeps_its_traceback(run, tmp_path, monkeypatch):
    """Only the file system's refusals are one line: another OSError is a bug, shown with its traceback."""
    import megaformer.commands.prepare as prepare

    def broken(*args, **kwargs):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(prepare, "prepare", broken)
    with pytest.raises(OSError, match="Bad file descriptor"):
        run("prepare", "--synthetic", "10", "--out", tmp_path / "out")


# ---- no silent fallback -----------------------------------------------------------------------------


@pytest.fixture
def damaged_run(text_run, tmp_path):
    """A copy of the run whose newest checkpoint (step 800) has a truncated model file."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(text_run["run"], copy)
    shard = copy / "checkpoints" / "step-00000800" / "model-tp00-of-01.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    return copy


def test_an_older_checkpoint_is_announced_and_recorded(damaged_run, text_run, run):
    code, out, err = run("translate", "--ckpt", damaged_run, "--input", text_run["src"], "--beam", "1", "--quiet")
    assert code == 0, err
    assert "skipping" in err and "step-00000800" in err and "using the older checkpoint" in err, err
    assert "step-00000700" in err

    code, out, err = run(
        "evaluate", "--ckpt", damaged_run, "--input", text_run["src"], "--ref", text_run["ref"], "--json", "--quiet"
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["step"] == 700 and result["checkpoint"].endswith("step-00000700"), result
    assert "step-00000800" in err and "using the older checkpoint" in err

    code, _, err = run("average", "--run-dir", damaged_run, "--last", "1", "--out", damaged_run / "avg.pt")
    assert code == 0, err
    assert "skipping" in err and "step-00000800" in err and "[700]" in err, err


def test_average_last_defaults_to_decode_average_last(text_run, run, tmp_path):
    code, _, err = run("average", "--run-dir", text_run["run"], "--out", tmp_path / "avg.pt")
    # decode.average_last is 5 and the run holds two checkpoints: the default was read, and named
    assert_one_line_error(code, err, "2 complete checkpoints, the run's decode.average_last asks for 5: pass --last 2")


def test_average_of_one_checkpoint_named_twice_is_refused(text_run, run, tmp_path):
    """`--ckpt S S` averaged S with itself (and any other named once at half its weight) without a word."""
    step = text_run["run"] / "checkpoints" / "step-00000800"
    again = step.parent / ".." / "checkpoints" / step.name
    code, _, err = run("average", "--ckpt", step, again, "--out", tmp_path / "avg.pt")
    assert_one_line_error(code, err, f"--ckpt {again}: given twice (as {step} too)")
    assert not (tmp_path / "avg.pt").exists()


@pytest.mark.parametrize("form", ["safetensors", "pt", "symlink", "hardlink", "copy"])
def test_average_of_one_checkpoint_under_two_names_is_refused(text_run, run, tmp_path, form):
    """`--ckpt EXPORT STEP` with the export made from that step averaged "steps [800, 800]": the duplicate check
    compared paths, not what they hold (an export's source step, a link, a copy of a model file)."""
    import os
    import shutil

    step = text_run["run"] / "checkpoints" / "step-00000800"
    if form in ("safetensors", "pt"):
        other = tmp_path / f"exported.{form}"
        code, _, err = run("export", "--ckpt", step, "--out", other)
        assert code == 0, err
        said = f"{other}: made from the same checkpoint as {step} (step 800"
        pair = (step, other)
    else:
        other = tmp_path / "model-again.pt"
        {"symlink": os.symlink, "hardlink": os.link, "copy": shutil.copyfile}[form](text_run["model"], other)
        said = f"--ckpt {other}: " + ("holds the same bytes as" if form == "copy" else "given twice (as")
        pair = (text_run["model"], other)
    code, _, err = run("average", "--ckpt", *pair, "--out", tmp_path / "avg.pt")
    assert_one_line_error(code, err, said)
    assert not (tmp_path / "avg.pt").exists()
    code, _, err = run(
        "average", "--ckpt", text_run["run"] / "checkpoints" / "step-00000700", other, "--out", tmp_path / "avg.pt"
    )
    assert code == 0, err  # another step of the run with it: averaged


def test_an_average_and_a_step_it_already_holds_are_refused(text_run, run, tmp_path):
    """An averaged model holds each of its steps: averaging it again with one of them would weigh that step twice."""
    steps = [text_run["run"] / "checkpoints" / f"step-{n:08d}" for n in (700, 800)]
    code, _, err = run("average", "--ckpt", *steps, "--out", tmp_path / "avg.pt")
    assert code == 0, err
    for step in steps:
        code, _, err = run("average", "--ckpt", tmp_path / "avg.pt", step, "--out", tmp_path / "again.pt")
        assert_one_line_error(code, err, f"{step}: made from the same checkpoint as {tmp_path / 'avg.pt'}")
        assert not (tmp_path / "again.pt").exists()
    code, _, err = run("average", "--ckpt", tmp_path / "avg.pt", text_run["model"], "--out", tmp_path / "again.pt")
    assert code == 0, err  # a model of another run with it: averaged


def test_average_takes_checkpoints_that_differ_only_in_dropout(text_run, run, tmp_path):
    """A resume may change model.dropout (it changes how the weights train, not what they compute): such
    checkpoints average; another width is still refused, naming it."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(text_run["run"], copy)
    meta = copy / "checkpoints" / "step-00000800" / "meta.json"
    fields = json.loads(meta.read_text())
    fields["config"]["model"]["dropout"] = 0.3
    meta.write_text(json.dumps(fields))
    code, _, err = run("average", "--run-dir", copy, "--last", "2", "--out", tmp_path / "avg.pt")
    assert code == 0, err
    fields["config"]["model"]["d_ff"] *= 2
    meta.write_text(json.dumps(fields))
    code, _, err = run("average", "--run-dir", copy, "--last", "2", "--out", tmp_path / "avg2.pt")
    assert_one_line_error(code, err, "model.d_ff")


def test_average_without_last_takes_no_more_than_the_run_keeps(text_run, run, tmp_path):
    """A run that keeps 2 checkpoints (train.keep_last) averages its 2 when decode.average_last asks for 5."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(text_run["run"], copy)
    for meta in (copy / "checkpoints").glob("step-*/meta.json"):
        fields = json.loads(meta.read_text())
        fields["config"]["train"]["keep_last"] = 2
        meta.write_text(json.dumps(fields))
    code, _, err = run("average", "--run-dir", copy, "--out", tmp_path / "avg.pt")
    assert code == 0, err
    assert "averaging the last 2: the run keeps 2 checkpoints (train.keep_last)" in err, err
    assert "[700, 800]" in err, err


def test_evaluate_prints_cased_and_lowercased_bleu(text_run, run):
    argv = ("evaluate", "--ckpt", text_run["model"], "--input", text_run["src"], "--ref", text_run["ref"], "--quiet")
    code, out, err = run(*argv, "--beam", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert "case:mixed" in lines[0] and lines[0].endswith("(cased BLEU)"), out
    assert "case:lc" in lines[1] and "lowercased" in lines[1], out
    code, out, err = run(*argv, "--beam", "1", "--json")
    result = json.loads(out)
    assert "case:lc" in result["signature_lc"] and "case:mixed" in result["signature"]
    assert result["bleu_lc"] >= result["bleu"] - 1e-9  # lowercasing can only add matches
    assert result["step"] == 2 and result["checkpoint"] == str(text_run["model"])


def test_output_closed_early_is_not_an_error():
    """`megaformer info ... | head`: the closed pipe is status 141 without a word, not a file-system error
    (BrokenPipeError is an OSError: the one-line OSError handler caught it first and re-raised it)."""
    import subprocess
    import sys

    probe = (
        "import errno, sys\n"
        "import megaformer.commands.info as info\n"
        "from megaformer import cli\n"
        "def closed(args):\n"
        "    raise BrokenPipeError(errno.EPIPE, 'Broken pipe')\n"
        "info.main = closed\n"
        'sys.stderr.write(f\'status {cli.main(["info", "--config", "configs/tiny.yaml"])}\')\n'
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "status 141", proc.stderr
