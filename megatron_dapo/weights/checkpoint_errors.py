"""The checkpoint error types, shared by the converter, the loaders and the training checkpoints."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointIntegrityError"]


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint is missing, malformed, incomplete, not one we read, or does not fit the model/optimizer it is
    loaded into; the message says what was found and what was expected.

    Both a ``ValueError`` (a bad input, as the converter and the loaders report it) and a ``RuntimeError`` (as the
    training checkpoints report a failed save or load), so handlers written for either keep catching it."""


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint's files do not match its manifest (truncated / corrupt / missing), or it was refused on save."""
