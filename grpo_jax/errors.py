"""Errors raised for bad checkpoints and tokenizer files (user input, so they carry a readable message)."""


class CheckpointError(ValueError):
    """A checkpoint, config or tokenizer file that cannot be used; the message names the file (and tensor)."""
