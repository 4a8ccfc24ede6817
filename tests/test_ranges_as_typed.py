"""A range prints what it accepts and a refused value is echoed as typed: ``train.lr_scale`` said it must be in
``(0.0, inf]`` yet refused ``inf``, and echoed ``1e309`` back as ``inf``."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error

from megaformer.config import RANGES
from megaformer.errors import interval

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")


@pytest.mark.parametrize(
    "argv, said",
    [
        (("--set", "train.lr_scale=1e309"), "train.lr_scale=1e309: must be a finite number"),
        (("--set", "train.lr_scale=inf"), "train.lr_scale=inf: must be a finite number"),
        (("--set", "train.lr_scale=-1e0"), "train.lr_scale=-1e0: must be in (0.0, inf)"),
        (("--set", "train.lr_scale=-1"), "train.lr_scale=-1: must be in (0.0, inf)"),
        (("--set", "model.d_model=0"), "model.d_model=0: must be in [1, inf)"),
    ],
)
def test_a_config_value_is_echoed_as_typed_against_the_range_it_may_take(run, argv, said):
    assert_one_line_error(*run("info", "--config", TINY, *argv)[::2], said)


def test_an_option_value_is_echoed_as_typed(run, tmp_path):
    model = tmp_path / "model.pt"
    model.write_bytes(b"x")
    code, _, err = run("translate", "--ckpt", model, "--lenpen", "-0.50")
    assert_one_line_error(code, err, "argument --lenpen: must be in [0.0, inf), got -0.50")


def test_no_range_prints_an_unbounded_end_as_accepted():
    """inf is refused everywhere (non-finite), so an unbounded end is open: ``inf)``, never ``inf]``."""
    for bounds in RANGES.values():
        text = interval(*bounds)
        assert not text.endswith("inf]") and not text.startswith("[-inf"), text
