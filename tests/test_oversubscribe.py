"""``train --nproc 64`` on 2 cores started 64 ranks; now refused before launch and by ``--check``, unless asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error

from megaformer.errors import ConfigError
from megaformer.train import launch
from megaformer.train.launch import OVERSUBSCRIBE_FACTOR, check_local_ranks

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")


def test_ranks_beyond_the_factor_a_core_are_refused_with_the_way_to_allow_them():
    check_local_ranks(2 * OVERSUBSCRIBE_FACTOR, 2, allowed=False)  # at the limit: fine
    check_local_ranks(64, 2, allowed=True)
    with pytest.raises(ConfigError, match=r"64 processes on this machine's 2 cores .*--oversubscribe"):
        check_local_ranks(64, 2, allowed=False)


@pytest.fixture(scope="module")
def data(synthetic_data: Path) -> Path:
    return synthetic_data


@pytest.mark.parametrize("check", [True, False])
def test_train_refuses_too_many_local_ranks_before_anything_starts(run, tmp_path, data, monkeypatch, check):
    monkeypatch.setattr(launch, "usable_cores", lambda: 1)
    monkeypatch.delenv(launch.OVERSUBSCRIBE_ENV, raising=False)
    started = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: started.append(a) or 0)
    nproc = str(OVERSUBSCRIBE_FACTOR + 1)
    argv = ["train", "--config", TINY, "--run-dir", tmp_path / "run", "--set", f"data.path={data}", "--nproc", nproc]
    code, _, err = run(*argv, *(["--check"] if check else []))
    assert_one_line_error(code, err, f"--nproc: {nproc} processes on this machine's 1 core")
    assert "--oversubscribe" in err and not started and not (tmp_path / "run").exists()


def test_oversubscribe_lets_the_check_pass(run, tmp_path, data, monkeypatch):
    monkeypatch.setattr(launch, "usable_cores", lambda: 1)
    argv = ["train", "--config", TINY, "--run-dir", tmp_path / "run", "--set", f"data.path={data}", "--check"]
    nproc = str(OVERSUBSCRIBE_FACTOR + 1)
    code, out, err = run(*argv, "--nproc", nproc, "--oversubscribe")
    assert code == 0 and f"{nproc} processes" in out, err
    monkeypatch.setenv(launch.OVERSUBSCRIBE_ENV, "1")
    assert run(*argv, "--nproc", nproc)[0] == 0
