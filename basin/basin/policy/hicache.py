"""SGLang with HiCache and nothing else: every session is admitted, queues run in arrival order."""

from __future__ import annotations

from basin.policy.base import Admission, Policy, SessionInfo


class HiCache(Policy):
    name = "hicache"

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        return Admission.ADMIT
