"""Errors (and warnings) that carry a message for the user: the CLI prints them on one line; errors exit non-zero."""

import warnings


class MegaformerError(Exception):
    """Base of every error whose message says what to change (no traceback is shown)."""


class ConfigError(MegaformerError, ValueError):
    """A config key or value, or a parallel layout, that cannot be used."""


class DataError(MegaformerError):
    """Input text, a tokenizer, a shard or a manifest that cannot be used; names the file (and line)."""


class CheckpointError(MegaformerError):
    """A checkpoint that is missing, torn, or does not match the model."""


class TrainingError(MegaformerError):
    """A run that cannot go on (a non-finite loss or gradient norm); says at which step and why."""


def interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    """The accepted values as an interval: an unbounded end is open (``[1, inf)``), as inf itself is refused."""
    left = "(-inf" if lo is None else f"{'(' if lo_open else '['}{lo}"
    right = "inf)" if hi is None else f"{hi}{')' if hi_open else ']'}"
    return f"{left}, {right}"


class MegaformerWarning(UserWarning):
    """Something the user should know that does not stop the command (samples left out, an emulated dtype).

    Printed as ``warning: <message>`` on one line: the source line Python's default format
    adds says nothing to a user (other warnings keep the default format).
    """


def _format_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001 (warnings' signature)
    if isinstance(category, type) and issubclass(category, MegaformerWarning):
        return f"warning: {message}\n"
    return _default_format(message, category, filename, lineno, line)


_default_format = warnings.formatwarning
warnings.formatwarning = _format_warning
