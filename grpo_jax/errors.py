"""The errors a user can fix, as one family of types.

`grpo-jax` catches `UserError` once, prints its message as one line and exits with its `exit_code`;
any other exception is a bug and keeps its traceback. A subclass may choose another exit code. The
message names the key, file, row or tensor, and the fix.

The classes are also importable from the modules that raise them (config_io.ConfigError,
data.DataError, cli.UsageError, trainer.TrainerError).
"""


class UserError(Exception):
    """A problem in the user's input or environment; the message is one line that says what to change."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A config problem: the message names the key, the value and what is allowed."""


class CheckpointError(UserError, ValueError):
    """A checkpoint, model or tokenizer file that cannot be used; the message names the file (and tensor)."""


class DataError(UserError, ValueError):
    """A dataset the pipeline cannot use: the message names the file, split or field."""


class UsageError(UserError, ValueError):
    """Bad command-line input (a missing file, an empty prompt file, ...)."""


class RunDirError(UserError):
    """A run directory that cannot be used: not writable, or held by another `grpo-jax train`."""


class TrainerError(UserError, RuntimeError):
    """The run cannot go on (the actor died, no groups arrive, nothing could be trained); the message says
    what was waited for."""
