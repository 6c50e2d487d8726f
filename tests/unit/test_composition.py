"""The composition: ThunderAgent's admission, Continuum's order and pins, Crossflow's borrowing."""

from basin.policy import Admission, CallInfo, Composition, SessionInfo


def test_composition_combines_its_parts() -> None:
    policy = Composition(capacity_tokens=10_000, prefill_tokens_per_s=30_000, prefill_gpu_tokens=1_000_000)
    assert policy.engine_options == {"decode_prefill": True}
    assert policy.on_session_arrival(5.0, SessionInfo("a", 5.0, "", 4_000)) is Admission.ADMIT
    assert (
        policy.on_session_arrival(6.0, SessionInfo("b", 6.0, "", 9_000)) is Admission.PARK
    )  # over the bound
    directives = policy.on_call_start(7.0, CallInfo("a", 0, 4_000))
    assert directives.priority == 5.0  # program FCFS, from Continuum
    assert "a" in policy.reasoning  # ThunderAgent's accounting follows the call
    assert policy.on_call_end(8.0, CallInfo("a", 0, 4_000), 4_500) == 0.0  # no tool history yet: no pin
    assert "a" in policy.acting
