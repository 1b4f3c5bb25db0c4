"""The store's errors: what a user sees in one line."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The store cannot be reached or used. The message names the location, never a credential."""


class CorruptArtifact(StoreError):
    """A committed artifact's files do not match its commit record (size or sha256).

    The message is one line naming the stage, the key and the file; the artifact has been moved to the
    store's quarantine folder by then, so the next run computes it again."""


__all__ = ["CorruptArtifact", "StoreError"]
