"""Errors a checkpoint can raise while it is read and turned into a model.

Their own module so that every configuration module can raise them without importing another
(``config`` reads ``mla_config``; both refuse options the engine does not implement).
"""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


class ModelLoadError(RuntimeError):
    """A checkpoint cannot be used; the message names the path and the problem on one line."""
