"""SGLang with HiCache and nothing else: every session is admitted, queues run in arrival order."""

from __future__ import annotations

from basin.policy.base import Admission, Policy, SessionInfo


class HiCache(Policy):
    name = "hicache"

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        return Admission.ADMIT


class Crossflow(HiCache):
    """Crossflow: decode instances run prefill chunks, sharing each step's token budget with decoding
    under a lease adapted to the 50 ms ITL SLO. Sessions are otherwise admitted and ordered as HiCache."""

    name = "crossflow"
    engine_options = {"decode_prefill": True}  # noqa: RUF012
