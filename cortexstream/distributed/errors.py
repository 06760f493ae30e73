"""The error distributed ranks raise on purpose: a rank died or hangs, the ranks diverged, or something cannot run
on several ranks (the message names the option, the model's head counts, or the rank)."""

from __future__ import annotations

from cortexstream.errors import CortexStreamError


class DistributedError(CortexStreamError, RuntimeError):
    """Ranks cannot (or can no longer) run the model together; the message says which rank and why."""
