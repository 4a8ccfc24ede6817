"""Errors that carry a message for the user: the CLI prints them on one line and exits non-zero."""


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
