"""``make wmt14``: the recipe's choices, and the whole recipe on a tree shaped like WMT'14's download, on a CPU.

The tree (tests/wmt14_tree.py) holds the five archives under their download names, with the
real member names and formats (SGML with entities, decoy language pairs), filled with a few
hundred sentences. The SLURM variant (train through slurm/train_big.sh) is in
tests/test_slurm_cluster.py, which has the cluster.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from wmt14_tree import build_wmt14_tree, make_wmt14

from megaformer.errors import ConfigError
from megaformer.recipes.wmt14 import (
    DOWNLOADS,
    RecipeError,
    Wmt14,
    average_command,
    check_downloads,
    evaluate_command,
    prepare_command,
    train_command,
    uses_slurm,
)


def _make(raw: Path, work: Path, *variables: str) -> subprocess.CompletedProcess:
    return make_wmt14(raw, work, *variables)


def _said(proc: subprocess.CompletedProcess) -> str:
    """The one line megaformer wrote to stderr (make adds its own ``make: ***`` line)."""
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("make")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_prepare_takes_the_papers_sets_from_the_archives(tmp_path):
    recipe = Wmt14(raw=tmp_path / "raw", work=tmp_path / "work")
    args = prepare_command(recipe)
    trains = [args[i + 1] for i, a in enumerate(args) if a == "--train"]
    assert [Path(t).name for t in trains] == [
        "training-parallel-europarl-v7.tgz",
        "training-parallel-commoncrawl.tgz",
        "training-parallel-nc-v9.tgz",
    ]
    assert args[args.index("--valid") + 1] == f"{tmp_path / 'raw' / 'dev.tgz'}:newstest2013"
    assert args[args.index("--test") + 1] == f"{tmp_path / 'raw' / 'test-full.tgz'}:newstest2014"  # 3,003, not 2,737
    assert args[args.index("--vocab-size") + 1] == "37000"
    assert (args[args.index("--src") + 1], args[args.index("--tgt") + 1]) == ("en", "de")


def test_training_goes_through_train_big_under_slurm_and_resumes(tmp_path):
    recipe = Wmt14(raw=tmp_path, work=tmp_path / "w", sets=("train.max_steps=5",), sbatch=("x", "sbatch"))
    argv, env = train_command(recipe, slurm=True)
    assert argv[:3] == ["x", "sbatch", "--wait"] and "slurm/train_big.sh" in argv
    assert argv[argv.index("slurm/train_big.sh") + 1 :] == [
        "--set",
        f"data.path={tmp_path / 'w' / 'data'}",
        "--set",
        "train.max_steps=5",
    ]
    assert env == {"RUN_DIR": str(tmp_path / "w" / "run"), "CONFIG": str(recipe.config)}
    local, env = train_command(recipe, slurm=False)
    assert env == {} and local[local.index("--resume") + 1] == "auto" and local[local.index("--nproc") + 1] == "1"
    assert average_command(recipe)[-3:] == ["--out", str(tmp_path / "w" / "averaged.pt"), "--force"]
    assert "--last" not in average_command(recipe)  # the config's decode.average_last: 20 for the big model
    assert evaluate_command(recipe)[evaluate_command(recipe).index("--lang") + 1] == "de"


def test_auto_launch_is_local_where_no_controller_answers(tmp_path):
    assert not uses_slurm(Wmt14(raw=tmp_path, work=tmp_path, sbatch=("false", "sbatch")))
    assert uses_slurm(Wmt14(raw=tmp_path, work=tmp_path, launch="slurm", sbatch=("false", "sbatch")))
    assert not uses_slurm(Wmt14(raw=tmp_path, work=tmp_path, launch="local"))
    with pytest.raises(ConfigError, match="--launch"):
        uses_slurm(Wmt14(raw=tmp_path, work=tmp_path, launch="cloud"))


def test_missing_downloads_are_named(tmp_path):
    with pytest.raises(RecipeError, match="no such folder"):
        check_downloads(tmp_path / "absent")
    (tmp_path / "dev.tgz").write_bytes(b"")
    with pytest.raises(RecipeError) as err:
        check_downloads(tmp_path)
    assert "dev.tgz" not in str(err.value) and all(n in str(err.value) for n in DOWNLOADS if n != "dev.tgz")


def test_make_wmt14_without_raw_or_downloads_is_one_line(tmp_path):
    proc = _make(tmp_path / "nothing", tmp_path / "work")
    assert proc.returncode != 0 and re.fullmatch(
        r"megaformer wmt14: error: argument --raw: \S*nothing: .*", _said(proc)
    )
    proc = _make(tmp_path, tmp_path / "work")
    assert proc.returncode != 0 and "training-parallel-europarl-v7.tgz" in _said(proc)
    assert not (tmp_path / "work" / "data").exists()


def test_make_wmt14_end_to_end_on_a_wmt_shaped_tree(tmp_path):
    raw = build_wmt14_tree(tmp_path / "raw")
    work = tmp_path / "work"
    proc = _make(raw, work, "WMT14_LAUNCH=local", "WMT14_NPROC=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for step in ("megaformer prepare", "megaformer train", "megaformer average", "megaformer evaluate"):
        assert f"$ {step}" in out or f"{step} " in out, step
    assert re.search(r"^BLEU\|.*= *\d", out, re.M) or "BLEU = " in out  # sacreBLEU's line
    assert re.search(r"^tokenized compound-split BLEU = \d+\.\d\d", out, re.M), out[-2000:]
    hyp = (work / "newstest2014.hyp").read_text().splitlines()
    ref = (work / "data" / "test.de").read_text().splitlines()
    assert len(hyp) == len(ref) > 0
    assert (work / "averaged.pt").is_file()
    # Again: the prepared data is kept, the run resumes at its end (no step trained twice).
    again = _make(raw, work, "WMT14_LAUNCH=local", "WMT14_NPROC=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is prepared already: kept" in again.stdout


def test_submit_options_that_do_not_parse_are_one_line(tmp_path):
    import sys

    from wmt14_tree import ROOT_OF_CHECKOUT

    for option, value in (("--sbatch-args", "--nodes='2"), ("--sbatch", "")):
        argv = [sys.executable, "-m", "megaformer.cli", "wmt14", "--raw", str(tmp_path), f"{option}={value}"]
        proc = subprocess.run(argv, cwd=ROOT_OF_CHECKOUT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith(f"megaformer wmt14: error: {option} "), proc.stderr
        assert proc.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()
