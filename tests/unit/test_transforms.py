import pytest

from basin.workload import compute_stats, load_workload
from basin.workload.synthetic import generate
from basin.workload.transforms import scale_outputs, scale_tool_time, share_prefix


def test_output_scale_grows_later_prompts_and_keeps_new_suffixes() -> None:
    (session,) = generate("terminal-bench", seed=4, sessions=1)
    scaled = scale_outputs(session, 3.0)
    scaled.validate()
    extra = 0
    for index, (before, after) in enumerate(zip(session.calls, scaled.calls, strict=True)):
        assert after.prompt_tokens == before.prompt_tokens + extra
        assert after.output_tokens == max(1, round(before.output_tokens * 3))
        assert after.new_tokens == (after.prompt_tokens if index == 0 else before.new_tokens)
        extra += after.output_tokens - before.output_tokens
    assert scaled.peak_context_tokens > session.peak_context_tokens


def test_output_scale_can_keep_the_recorded_prompts() -> None:
    """--keep-prompts: the extra output is not resent (reasoning a chat template strips), so only the
    outputs change, and the session's footprint grows by its last output's extra tokens alone."""
    (session,) = generate("terminal-bench", seed=4, sessions=1)
    kept = scale_outputs(session, 3.0, resend=False)
    kept.validate()
    for before, after in zip(session.calls, kept.calls, strict=True):
        assert (after.prompt_tokens, after.new_tokens) == (before.prompt_tokens, before.new_tokens)
        assert after.output_tokens == max(1, round(before.output_tokens * 3))
    assert kept.peak_context_tokens < scale_outputs(session, 3.0).peak_context_tokens
    loaded = load_workload("terminal-bench", 4, output_scale=3.0, sessions=1, resend_outputs=False)
    assert loaded == [kept]


def test_tool_time_scale_multiplies_gaps_only() -> None:
    sessions = generate("terminal-bench", seed=0, sessions=20)
    base, slow = compute_stats(sessions), compute_stats(load_workload("terminal-bench", 0, 3.0, sessions=20))
    assert slow.median_tool_gap_s == pytest.approx(3 * base.median_tool_gap_s)
    assert slow.median_prompt_tokens == base.median_prompt_tokens
    assert scale_tool_time(sessions[0], 1.0) is sessions[0]
    with pytest.raises(ValueError):
        scale_tool_time(sessions[0], -1)


def test_a_shared_prefix_opens_the_first_prompt_and_is_capped_by_it() -> None:
    sessions = generate("terminal-bench", seed=0, sessions=50)
    shared = [share_prefix(s, 8_000) for s in sessions]
    for before, after in zip(sessions, shared, strict=True):
        after.validate()
        assert after.calls == before.calls  # the calls are the same; only what opens them is shared
        assert after.shared_prefix_tokens == min(8_000, before.first_prompt_tokens)
    assert any(s.first_prompt_tokens < 8_000 for s in sessions)  # the cap was exercised
    with pytest.raises(ValueError, match="must not be negative"):
        share_prefix(sessions[0], -1)
