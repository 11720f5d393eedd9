"""A crash at a chosen step, for the tests of an auditor that must resume after one."""

from __future__ import annotations


class Crash(Exception):
    """What `crash_at`'s progress hook raises: the auditor 'killed' there."""


def crash_at(step: int):
    """A progress hook that raises Crash once step `step` is done (replayed or stitched)."""
    def progress(t, _steps):
        if t == step:
            raise Crash(f"auditor killed after step {t}")
    return progress
