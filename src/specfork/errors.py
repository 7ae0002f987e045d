"""User-facing errors.

Every mistake a user can make (a bad model name, an unreadable file, an invalid sampling value)
raises a subclass of :class:`SpecforkError` whose message names the problem and the fix. The CLI
prints such errors as one line and exits non-zero; the server turns them into HTTP 400.
"""


class SpecforkError(Exception):
    """Base class of errors caused by user input; the message is shown to the user as is."""


class ModelNotFoundError(SpecforkError):
    """A model name that is neither a packaged model nor an existing path."""


class ModelFormatError(SpecforkError):
    """A model file or folder that cannot be read (corrupt, unsupported type or architecture)."""


class ConfigError(SpecforkError):
    """An invalid configuration value (sampling parameters, generation limits, ...)."""


class ConstraintError(ConfigError):
    """A constraint (JSON schema, regex) that cannot drive generation: it matches no text, or
    this model's tokenizer cannot follow it."""


class PromptError(SpecforkError):
    """A prompt that cannot be run: empty, or longer than the model's context."""
