"""FAULT INJECTION: an auditor that lies on purpose, for tests and demos of the dispute game.

Nothing here runs unless `ovt-auditor serve|audit --inject-fault false-challenge:K` (or a test)
asks for it. The one kind, the lying auditor of SPEC §5.4 ("auditor at fault: false challenge"):

    false-challenge:k  after replaying step k, the auditor stores (and commits to) its S_k one
                       ULP off, so its leaf k differs from an honest trainer's and the audit
                       files a challenge at k that the arbiter must reject

The fault applies to every job this auditor audits.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.errors import ConfigError
from protocol.job.faults import AUDITOR_KINDS as KINDS  # one vocabulary of faults, shared
from protocol.job.faults import Fault, one_ulp_off, parse_fault
from protocol.job.run import StepHooks


def parse_auditor_fault(text: str) -> Fault:
    """Parse "false-challenge:K". Raises ConfigError naming the allowed kinds."""
    return parse_fault(text, KINDS)


class AuditorFaults(StepHooks):
    """The faults of one lying auditor, as step hooks for `replay_job`."""

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.faults = tuple(faults)
        unknown = [f for f in self.faults if f.kind not in KINDS]
        if unknown:
            raise ConfigError(f"not an auditor fault: {', '.join(map(str, unknown))}")

    def after(self, t, ex, log):
        if any(f.kind == "false-challenge" and f.step == t for f in self.faults):
            ex.load_state(one_ulp_off(ex.state()))
        return ex.state(), log
