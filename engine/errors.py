"""The engine's errors. Each is a `TierKVError`, so the `tierkv` command
prints it as one line."""
from __future__ import annotations

from tiers.types import TierKVError


class ModelError(TierKVError):
    """Unknown model, or a model directory that cannot be loaded."""


class PromptError(TierKVError, ValueError):
    """A prompt the engine cannot run (empty, too long, token ids out of range)."""
