"""Every path a command writes, walked through what a file system refuses: one line naming the path and the true
cause (never a traceback, never another cause's advice), status 2, nothing written.

A 300-character name (ENAMETOOLONG) in ``translate --output``, ``train --run-dir``, ... ended in a traceback, and a
run directory whose ``.lock`` is a directory ended ``train`` in IsADirectoryError while ``train --check`` said yes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error

from megaformer.errors import ConfigError
from megaformer.files import path_refusal
from megaformer.train.run_lock import LOCK_NAME, RunLock

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
LONG = "x" * 300


def _argv(command: str, option: str, path: Path | str, model: Path) -> tuple:
    """``command`` with ``option`` set to ``path`` and whatever else it needs to reach its path checks."""
    leads = {
        "translate": ("translate", "--ckpt", model),
        "average": ("average", "--ckpt", model),
        "export": ("export", "--ckpt", model),
        "train": ("train", "--config", TINY),
        "prepare": ("prepare", "--synthetic", "10"),
        "evaluate": ("evaluate", "--ckpt", model, "--input", model, "--ref", model),
        "reshard": ("reshard", "--ckpt", model, "--tp", "1"),
    }
    return (*leads[command], option, path)


OUTPUTS = [
    ("translate", "--output", ".txt"),
    ("average", "--out", ".pt"),
    ("export", "--out", ".safetensors"),
    ("train", "--run-dir", ""),
    ("prepare", "--out", ""),
    ("evaluate", "--output", ".txt"),
    ("reshard", "--out", ""),
]


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not read: the path checks come first")
    return path


def _refused(run, tmp_path, argv, said: str, unsaid: tuple[str, ...] = ()) -> None:
    before = _listing(tmp_path)
    code, _, err = run(*argv)
    assert_one_line_error(code, err, said)
    for wrong in unsaid:
        assert wrong not in err, err
    assert _listing(tmp_path) == before  # nothing written (the probe file is gone)


@pytest.mark.parametrize("command, option, suffix", OUTPUTS)
def test_a_name_too_long_is_one_line(run, tmp_path, model, command, option, suffix):
    path = tmp_path / (LONG + suffix)
    said = f"{path}: the name is longer than the file system allows (255 bytes a component)"
    _refused(run, tmp_path, _argv(command, option, path, model), said)


@pytest.mark.parametrize("command, option, suffix", OUTPUTS)
def test_a_name_too_long_below_a_new_folder_is_one_line(run, tmp_path, model, command, option, suffix):
    path = tmp_path / "new" / (LONG + suffix)
    if suffix in (".txt", ".pt"):  # a file's folder must exist
        (tmp_path / "new").mkdir()
    _refused(run, tmp_path, _argv(command, option, path, model), "bytes a component")


@pytest.mark.parametrize("command, option, suffix", OUTPUTS)
def test_a_symlink_loop_is_named_a_loop(run, tmp_path, model, command, option, suffix):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    _refused(
        run, tmp_path, _argv(command, option, tmp_path / "a", model), "a loop of symbolic links", ("no such file",)
    )


@pytest.mark.parametrize("command, option, suffix", OUTPUTS)
def test_a_path_below_a_file_names_the_file(run, tmp_path, model, command, option, suffix):
    (tmp_path / "plain").write_text("a file\n")
    path = tmp_path / "plain" / ("out" + suffix)
    _refused(run, tmp_path, _argv(command, option, path, model), f"{tmp_path / 'plain'} is a file, not a directory")


@pytest.mark.parametrize("command, option, suffix", OUTPUTS)
def test_proc_is_named_a_special_file_system_not_a_full_disk(run, tmp_path, model, command, option, suffix):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    path = f"/proc/megaformer-test{suffix}"
    _refused(run, tmp_path, _argv(command, option, path, model), "takes no new files", ("free space", "no such"))


@pytest.mark.parametrize("command, option", [("translate", "--output"), ("average", "--out")])
def test_a_directory_where_a_file_goes_is_one_line(run, tmp_path, model, command, option):
    (tmp_path / "d").mkdir()
    _refused(run, tmp_path, _argv(command, option, tmp_path / "d", model), "is a directory, expected a file")


@pytest.mark.parametrize(
    "argv",
    [
        ("translate", "--ckpt", "{p}"),
        ("average", "--ckpt", "{p}", "--out", "{tmp}/avg.pt"),
        ("train", "--config", "{p}"),
    ],
)
def test_an_input_that_is_a_loop_or_too_long_is_named_so(run, tmp_path, argv):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    for path, said in ((tmp_path / "a", "a loop of symbolic links"), (tmp_path / LONG, "bytes a component")):
        filled = [str(a).format(p=path, tmp=tmp_path) for a in argv]
        _refused(run, tmp_path, filled, said, ("no such file",))


@pytest.mark.parametrize("command", ["translate", "export", "average"])
def test_a_model_file_replaced_by_a_directory_is_not_called_missing(run, tmp_path, model, command):
    (tmp_path / "gone.pt").mkdir()
    tail = {
        "translate": ("--input", model),
        "export": ("--out", tmp_path / "e.pt"),
        "average": ("--out", tmp_path / "a.pt"),
    }
    argv = [command, "--ckpt", tmp_path / "gone.pt", *tail[command]]
    code, _, err = run(*argv)
    assert_one_line_error(code, err, f"{tmp_path / 'gone.pt'}: is a directory, expected a model file")
    assert "no such" not in err and "missing" not in err and "not found" not in err
    code, _, err = run("translate", "--ckpt", model, "--input", tmp_path / "gone.pt")
    assert_one_line_error(code, err, "is a directory, expected a file")


@pytest.mark.parametrize(
    "code, said, unsaid",
    [
        (errno.ENAMETOOLONG, "the name is longer than the file system allows", "no such"),
        (errno.EISDIR, "is a directory, expected a file", "missing"),
        (errno.ELOOP, "a loop of symbolic links", "no such"),
        (errno.EACCES, "Permission denied: make it accessible", "free space"),
        (errno.EPERM, "make it accessible", "free space"),
        (errno.EROFS, "Read-only file system: write to another place", "free space"),
        (errno.ENOSPC, "No space left on device: free space there", "accessible"),
    ],
)
def test_each_cause_is_said_as_itself(tmp_path, code, said, unsaid):
    line = path_refusal(tmp_path / "x", OSError(code, os.strerror(code)))
    assert line.startswith(f"{tmp_path / 'x'}: ") and said in line and unsaid not in line and "\n" not in line


def test_a_refusal_to_create_in_an_existing_folder_is_not_called_missing(tmp_path):
    line = path_refusal("/proc/x", OSError(errno.ENOENT, "No such file or directory"), creating=True)
    assert "special file system" in line and "no such" not in line.lower()


@pytest.mark.parametrize(
    "code, said",
    [
        (errno.ENAMETOOLONG, "the name is longer than the file system allows"),
        (errno.ELOOP, "a loop of symbolic links"),
        (errno.EISDIR, "is a directory, expected a file"),
        (errno.ENOTDIR, "not a directory"),
    ],
)
def test_a_refusal_met_while_writing_is_one_line_naming_the_path(run, tmp_path, monkeypatch, code, said):
    """Past the checks (a name that changed under the command), the same causes, said the same way."""
    import megaformer.commands.prepare as prepare

    where = tmp_path / "out" / "shard-000.tar"

    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(where))

    monkeypatch.setattr(prepare, "prepare", refused)
    code_, _, err = run("prepare", "--synthetic", "10", "--out", tmp_path / "out")
    assert_one_line_error(code_, err, f"megaformer prepare: error: {where}: ")
    assert said in err


def test_the_run_lock_refuses_a_lock_that_is_a_directory_in_one_line(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    for call in (lambda: RunLock(tmp_path, None).check_free(), lambda: RunLock(tmp_path, None).acquire(0.0)):
        with pytest.raises(ConfigError, match=f"--run-dir {tmp_path}: .*{LOCK_NAME}: is a directory, expected a file"):
            call()
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]


def test_the_run_lock_refuses_a_lock_in_a_link_loop(tmp_path):
    os.symlink(tmp_path / "b", tmp_path / LOCK_NAME)
    os.symlink(tmp_path / LOCK_NAME, tmp_path / "b")
    for call in (lambda: RunLock(tmp_path, None).check_free(), lambda: RunLock(tmp_path, None).acquire(0.0)):
        with pytest.raises(ConfigError, match="a loop of symbolic links"):
            call()


@pytest.fixture(scope="module")
def data(synthetic_data: Path) -> Path:
    return synthetic_data


@pytest.mark.parametrize("check", [True, False])
def test_train_and_its_check_refuse_a_lock_that_is_a_directory(run, tmp_path, data, check):
    """``train --check`` said yes (status 0) for a run directory that ``train`` then failed in a traceback."""
    run_dir = tmp_path / "run"
    (run_dir / LOCK_NAME).mkdir(parents=True)
    argv = ("train", "--config", TINY, "--run-dir", run_dir, "--set", f"data.path={data}")
    _refused(run, tmp_path, argv + (("--check",) if check else ()), "is a directory, expected a file")


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "checkpoints"])
def test_train_and_its_check_refuse_a_run_file_of_the_wrong_kind(run, tmp_path, data, check, name):
    """A folder where the run writes a file (or a file where it keeps its checkpoints) passed ``--check``."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if name == "checkpoints":
        (run_dir / name).write_text("not a folder\n")
    else:
        (run_dir / name).mkdir()
    argv = ("train", "--config", TINY, "--run-dir", run_dir, "--set", f"data.path={data}")
    _refused(run, tmp_path, argv + (("--check",) if check else ()), f"{name}: cannot be written")


@pytest.mark.parametrize(
    "code, said", [(errno.ELOOP, "a loop of symbolic links"), (errno.ENOENT, "takes no new files")]
)
def test_an_export_refused_while_writing_names_the_cause_not_a_full_disk(tmp_path, code, said):
    from megaformer.export import ExportError
    from megaformer.export.safetensors_format import staged_output

    with pytest.raises(ExportError) as refused, staged_output(tmp_path / "m.safetensors", False, directory=False):
        raise OSError(code, os.strerror(code), "/proc/megaformer.safetensors")
    assert said in str(refused.value) and "free space" not in str(refused.value)
    assert _listing(tmp_path) == []


def test_a_checkpoint_save_refused_by_a_path_names_the_cause_not_a_full_disk(tmp_path):
    from megaformer.checkpoint.save import _writing
    from megaformer.errors import CheckpointError

    tmp = tmp_path / ".step-00000010.tmp"
    tmp.mkdir()
    with pytest.raises(CheckpointError) as refused, _writing(tmp):
        raise OSError(errno.EISDIR, "Is a directory", str(tmp / "meta.json"))
    assert "meta.json: is a directory, expected a file" in str(refused.value)
    assert "free space" not in str(refused.value) and not tmp.exists()
