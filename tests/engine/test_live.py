"""The engine extension live: a real SGLang 0.5.23 prefill–decode pair on CPU (NIXL over UCX on DRAM, a
tiny random-weight model, Basin's plugin loaded by SGLang's loader) behind sglang-router 0.3.2, started
once per session by the `live_pair` fixture. Every observation is SGLang's own: `/v1/loads`, `/metrics`
(SGLang's series and the plugin's `sglang:basin_*`), the engines' request logs and the generated tokens.

Without the plugin (no `SGLANG_PLUGINS=basin`) the pair does not start (SGLang refuses
`prefill_complete` on NIXL), so every test here fails.
"""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytestmark = [pytest.mark.live, pytest.mark.slow]

GREEDY = {"temperature": 0.0}


def token_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def poll(check: Callable[[], Any], what: str, deadline_s: float = 120.0) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {deadline_s:.0f} s: {what}")
        time.sleep(0.2)


def loads(pair: Any, role: str) -> dict[str, Any]:
    """SGLang's own load report for one engine (`GET /v1/loads`, computed when asked)."""
    import requests

    return requests.get(f"{pair.url(role)}/v1/loads", timeout=10).json()["loads"][0]


def basin(pair: Any, role: str) -> dict[str, float]:
    m = pair.metrics(role)
    return {
        k.removeprefix("sglang:basin_"): v
        for k, v in m.items()
        if k.startswith("sglang:basin_") and "{" not in k
    }


def retracted(pair: Any) -> float:
    """SGLang's retraction gauge on decode. SGLang sets it when its scheduler first logs decode stats
    (every `--decode-log-interval` steps), so on a fresh pair it can be absent: nothing counted yet, 0.
    Each answer's `meta_info.num_retractions` is the per-request evidence the test also checks."""
    return pair.metrics("decode").get("sglang:num_retracted_reqs", 0.0)


def marked(session: str, lend: bool = True) -> dict[str, Any]:
    return {"basin_session": session, "basin_lend": lend}


def generate(
    prompt: list[int], tokens: int, custom: dict[str, Any] | None = None, **top: Any
) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": tokens, **GREEDY}
    if custom is not None:
        params["custom_params"] = custom
    return {"input_ids": prompt, "sampling_params": params, **top}


def reference_tokens(model_dir: Any, prompt: list[int], tokens: int) -> list[int]:
    """The tiny model's greedy continuation computed by transformers in this process (fp32, no cache
    reuse, no disaggregation): what any correct serving path must produce."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


# 1. Reservation at prefill completion ------------------------------------------------------------------


def test_decode_reserves_nothing_before_prefill_completes(live_pair: Any) -> None:
    """With `prefill_complete` on NIXL (accepted only through the plugin), a request waiting for its
    prefill holds no decode KV: while prefill is paused the request sits in decode's prealloc queue and
    decode's used tokens do not move; once prefill runs, the output is the model's own."""
    pair = live_pair
    prompt, tokens = token_ids(300, seed=1), 8
    expected = reference_tokens(pair.model, prompt, tokens)
    before = loads(pair, "decode")
    pair.post("prefill", "/pause_generation", {"mode": "in_place"})
    with ThreadPoolExecutor(1) as pool:
        try:
            call = pool.submit(pair.post, "router", "/generate", generate(prompt, tokens, rid="reserve-1"))
            waiting = poll(
                lambda: (
                    (lo := loads(pair, "decode"))["disaggregation"]["decode_prealloc_queue_reqs"] >= 1 and lo
                ),
                "the request waiting in decode's prealloc queue",
            )
            assert waiting["num_used_tokens"] == before["num_used_tokens"]
            assert waiting["num_prealloc_ready_tokens"] == 0
            assert waiting["disaggregation"]["decode_transfer_queue_reqs"] == 0
            assert waiting["num_running_reqs"] == 0
        finally:
            pair.post("prefill", "/continue_generation", {})
        answer = call.result(timeout=300)
    assert answer["output_ids"] == expected
    assert answer["meta_info"]["num_retractions"] == 0
    after = loads(pair, "decode")
    assert after["disaggregation"]["decode_prealloc_queue_reqs"] == 0


# 2. Lending: a marked call leaves a unit; units are reclaimed before any retraction ---------------------


def test_marked_call_leaves_unit_and_pressure_reclaims_before_retraction(live_pair: Any) -> None:
    pair = live_pair
    start = basin(pair, "decode")
    retracted_before = retracted(pair)
    sessions = [f"lend-{i}" for i in range(3)]
    for i, session in enumerate(sessions):
        pair.dispatch("/generate", generate(token_ids(500, seed=100 + i), 4, marked(session)))
    lent = basin(pair, "decode")
    assert lent["lent_units"] == start["lent_units"] + 3
    assert lent["lent_tokens"] >= start["lent_tokens"] + 3 * 500
    # An unmarked call is released as SGLang always does: no unit.
    pair.dispatch("/generate", generate(token_ids(200, seed=150), 4))
    assert basin(pair, "decode")["lent_units"] == lent["lent_units"]

    # Pressure: six unmarked calls whose prompts need more than decode's free room beside the units.
    capacity = loads(pair, "decode")["max_total_num_tokens"]
    prompts = [token_ids(600, seed=200 + i) for i in range(6)]
    assert capacity - lent["lent_tokens"] < 6 * 616
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: pair.dispatch("/generate", generate(p, 16)), prompts))
    after = basin(pair, "decode")
    assert after["reclaimed_tokens_total"] > start["reclaimed_tokens_total"]
    assert after["lent_tokens"] < lent["lent_tokens"]
    assert retracted(pair) == retracted_before == 0
    for answer in answers:
        assert answer["meta_info"]["num_retractions"] == 0
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert len(answer["output_ids"]) == 16


# 5. Through the router ---------------------------------------------------------------------------------

# What sglang-router 0.3.2 carries to the engines of the three fields the gateway sets, per route (read
# in its source, sgl-router/src/protocols/{generate,chat,completion,sampling_params}.rs: the PD router
# re-serialises the typed request; only CompletionRequest keeps unknown fields, `#[serde(flatten)] other`).
ROUTER_CARRIES = {
    "/generate": {"rid", "priority"},
    "/v1/completions": {"rid", "priority", "custom_params"},
    "/v1/chat/completions": set(),
}


def call_body(route: str, session: str, rid: str, priority: int) -> dict[str, Any]:
    custom = marked(session)
    if route == "/generate":
        return generate(
            token_ids(120, seed=zlib.crc32(session.encode())), 4, custom, rid=rid, priority=priority
        )
    common = {"model": "ignored", "max_tokens": 4, "temperature": 0.0, "custom_params": custom,
              "rid": rid, "priority": priority}  # fmt: skip
    text = f"Session {session}: the quick brown fox jumps over the lazy dog. " * 8
    if route == "/v1/completions":
        return {**common, "prompt": text}
    return {**common, "messages": [{"role": "user", "content": text}]}


def arrived(entry: dict[str, Any], session: str, rid: str, priority: int) -> set[str]:
    """Which of the gateway's fields an engine's `request.received` log entry shows."""
    obj = entry["obj"]
    found = set()
    if obj.get("rid") == rid:
        found.add("rid")
    if obj.get("priority") == priority:
        found.add("priority")
    custom = (obj.get("sampling_params") or {}).get("custom_params") or {}
    if custom.get("basin_session") == session and custom.get("basin_lend") is True:
        found.add("custom_params")
    return found


def calls_since(pair: Any, role: str, seen: int) -> list[dict[str, Any]]:
    """The calls an engine logged after its first `seen` entries, without SGLang's own health probes
    (the router's `/health` makes each engine run a `HEALTH_CHECK_*` generation now and then)."""
    return [e for e in pair.received(role)[seen:] if not str(e.get("rid", "")).startswith("HEALTH_CHECK")]


def send_and_observe(
    pair: Any, via: str, route: str, session: str, rid: str, priority: int
) -> list[set[str]]:
    seen = {role: len(pair.received(role)) for role in ("prefill", "decode")}
    body = call_body(route, session, rid, priority)
    if via == "router":
        body["model"] = str(pair.model)
        pair.post("router", route, body)
    else:
        body["model"] = str(pair.model)
        pair.dispatch(route, body)
    out = []
    for role in ("prefill", "decode"):
        new = poll(lambda role=role: calls_since(pair, role, seen[role]), f"{role} logs the {route} call")
        assert len(new) == 1, new
        out.append(arrived(new[0], session, rid, priority))
    return out


@pytest.mark.parametrize("route", list(ROUTER_CARRIES))
def test_router_carries(live_pair: Any, route: str) -> None:
    """What reaches both engines when the gateway's call goes through sglang-router 0.3.2, and whether a
    marked call leaves a unit (it does only where `custom_params` arrives)."""
    pair = live_pair
    session = f"router{route.replace('/', '-')}"
    units = basin(pair, "decode")["lent_units"]
    prefill_seen, decode_seen = send_and_observe(pair, "router", route, session, f"r{route[-4:]}-1", 7)
    assert prefill_seen == decode_seen == ROUTER_CARRIES[route]
    left = basin(pair, "decode")["lent_units"] - units
    assert left == (1 if "custom_params" in ROUTER_CARRIES[route] else 0)


@pytest.mark.parametrize("route", list(ROUTER_CARRIES))
def test_pair_addressed_directly_carries_everything(live_pair: Any, route: str) -> None:
    """The gateway's way around the router: the same body with bootstrap host/port/room posted to
    prefill and decode at once (what the router's PD mode does) carries every field on every route."""
    pair = live_pair
    session = f"direct{route.replace('/', '-')}"
    units = basin(pair, "decode")["lent_units"]
    prefill_seen, decode_seen = send_and_observe(pair, "direct", route, session, f"d{route[-4:]}-1", 9)
    assert prefill_seen == decode_seen == {"rid", "priority", "custom_params"}
    assert basin(pair, "decode")["lent_units"] == units + 1


def test_router_never_reaches_for_the_hub(live_pair: Any) -> None:
    from pair import HUB_MARKERS

    log = re.sub(r"\x1b\[[0-9;]*m", "", live_pair.log("router"))
    assert "register_tokenizer" in log  # the router did load a tokenizer (from the local model folder)
    assert not [m for m in HUB_MARKERS if m.lower() in log.lower()]


# 3. Unit fetch after prefill lost the prefix -----------------------------------------------------------


def flush_prefill(pair: Any) -> None:
    """SGLang's `/flush_cache` on prefill (refused while requests are in flight: poll until it is done)."""
    import requests

    poll(
        lambda: requests.post(f"{pair.prefill_url}/flush_cache", timeout=30).status_code == 200,
        "prefill's cache flushed",
    )


def test_next_turn_fetches_unit_after_prefill_flush(live_pair: Any) -> None:
    """After prefill lost a session's prefix (`/flush_cache`), the session's next call fetches the prefix
    from decode's unit over NIXL instead of recomputing it: decode's unit hits and fetched tokens rise,
    and SGLang's prefill reports the prefix as cached for that call although its cache was just flushed;
    the output equals a recompute's (the same prompt, no unit, after another flush)."""
    pair = live_pair
    turn1 = token_ids(400, seed=300)
    turn2 = turn1 + token_ids(40, seed=301)
    pair.dispatch("/generate", generate(turn1, 4, marked("fetch-1"), rid="fetch-1-turn1"))
    flush_prefill(pair)
    before = basin(pair, "decode")
    fallbacks = basin(pair, "prefill")["unit_fallbacks_total"]
    answer = pair.dispatch("/generate", generate(turn2, 8, marked("fetch-1"), rid="fetch-1-turn2"))
    after = basin(pair, "decode")
    assert after["unit_hits_total"] == before["unit_hits_total"] + 1
    assert after["fetched_tokens_total"] - before["fetched_tokens_total"] == len(turn1)
    assert basin(pair, "prefill")["unit_fallbacks_total"] == fallbacks
    assert pair.finished("prefill")["fetch-1-turn2"]["cached_tokens"] == len(turn1)
    flush_prefill(pair)
    recomputed = pair.dispatch("/generate", generate(turn2, 8, rid="fetch-1-recompute"))
    assert pair.finished("prefill")["fetch-1-recompute"]["cached_tokens"] == 0
    assert basin(pair, "decode")["fetched_tokens_total"] == after["fetched_tokens_total"]
    assert answer["output_ids"] == recomputed["output_ids"]


def test_decode_stalled_mid_fetch_falls_back_to_recompute(live_pair: Any) -> None:
    """A decode instance that stops serving (SGLang's in-place pause stops its scheduler loop, which polls
    the unit service) makes prefill give up the fetch at its deadline and recompute; once decode resumes,
    the call completes with the model's own output."""
    pair = live_pair
    turn1 = token_ids(300, seed=400)
    turn2 = turn1 + token_ids(30, seed=401)
    pair.dispatch("/generate", generate(turn1, 4, marked("stall-1")))
    flush_prefill(pair)
    fallbacks = basin(pair, "prefill")["unit_fallbacks_total"]
    fetched = basin(pair, "decode")["fetched_tokens_total"]
    pair.post("decode", "/pause_generation", {"mode": "in_place"})
    with ThreadPoolExecutor(1) as pool:
        try:
            call = pool.submit(
                pair.dispatch, "/generate", generate(turn2, 8, marked("stall-1"), rid="stall-1-turn2")
            )
            poll(
                lambda: basin(pair, "prefill")["unit_fallbacks_total"] > fallbacks,
                "prefill abandoning the fetch from the paused decode",
            )
        finally:
            pair.post("decode", "/continue_generation", {})
        answer = call.result(timeout=300)
    assert basin(pair, "decode")["fetched_tokens_total"] == fetched
    assert pair.finished("prefill")["stall-1-turn2"]["cached_tokens"] == 0
    assert answer["output_ids"] == reference_tokens(pair.model, turn2, 8)


# 4. Priority -------------------------------------------------------------------------------------------


def test_lower_priority_value_leaves_the_prealloc_queue_first(live_pair: Any) -> None:
    """Two calls that wait together in decode's prealloc queue (sent through the router, which carries
    `priority` on /generate, with priorities 30 then 10) are reserved lowest value first. A running
    blocker holds decode's KV; decode is paused in place while both calls are prefilled (a paused server
    holds new calls in its tokenizer manager), then resumed, so both reach its prealloc queue together.
    Each needs its 1800-token prompt plus SGLang's 512 reserved decode tokens, so they fit neither beside
    the blocker nor beside each other: once the blocker is aborted decode takes one, then the other, and
    their decode-forward entry times say in which order."""
    pair = live_pair
    with ThreadPoolExecutor(3) as pool:
        # max_new_tokens stays within SGLang's 512 reserved tokens: see docs/engine-ext.md, "Live on CPU"
        blocker = pool.submit(
            pair.dispatch, "/generate", generate(token_ids(1900, seed=600), 500, rid="prio-blocker")
        )
        poll(lambda: loads(pair, "decode")["num_running_reqs"] >= 1, "the blocker decoding")
        calls = {}
        pair.post("decode", "/pause_generation", {"mode": "in_place"})
        try:
            for n, priority in enumerate((30, 10), start=1):
                body = generate(
                    token_ids(1800, seed=600 + priority), 4, rid=f"prio-{priority}", priority=priority
                )
                calls[priority] = pool.submit(pair.post, "router", "/generate", body)
                poll(
                    lambda n=n: loads(pair, "prefill")["disaggregation"]["prefill_inflight_queue_reqs"] >= n,
                    f"{n} calls prefilled and waiting for decode",
                )
        finally:
            pair.post("decode", "/continue_generation", {})
        try:
            queued = poll(
                lambda: (lo := loads(pair, "decode"))["queues"]["prealloc_ready"] >= 2 and lo,
                "both calls prefilled and in decode's prealloc queue (not SGLang's health probes)",
            )
            assert queued["num_running_reqs"] == 1  # the blocker alone: neither call fits beside it
        finally:
            pair.post("decode", "/abort_request", {"rid": "prio-blocker"})
        answers = {priority: call.result(timeout=300) for priority, call in calls.items()}
        blocker.exception(timeout=300)  # aborted: SGLang answers with an abort (or an error status)
    entered = {p: a["meta_info"]["forward_entry_time"] for p, a in answers.items()}
    assert entered[10] < entered[30], entered
