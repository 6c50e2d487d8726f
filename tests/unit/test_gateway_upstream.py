"""Where the gateway sends a call (basin_gateway/upstream.py): the router, or a prefill and a decode
engine chosen per session, with the PD bootstrap fields that pair the two halves."""

from __future__ import annotations

from collections import Counter

import pytest

from basin.errors import BasinError
from basin_gateway.settings import Settings, from_environment
from basin_gateway.upstream import (
    PrefillEngine,
    Upstreams,
    bootstrap_fields,
    parse_prefill,
    parse_prefill_list,
)

PREFILL = (PrefillEngine("http://10.0.0.1:30000", 8998), PrefillEngine("http://10.0.0.2:30000", 8999))
DECODE = ("http://10.0.1.1:30000", "http://10.0.1.2:30000", "http://10.0.1.3:30000")


def test_without_engines_every_call_goes_to_the_router() -> None:
    upstreams = Upstreams("http://router:30000/", (), ())
    assert not upstreams.direct
    target = upstreams.pick("s1")
    assert target.url == "http://router:30000" and target.prefill is None
    assert upstreams.engines() == ("http://router:30000",)


def test_a_session_keeps_its_engines_and_sessions_spread_over_them() -> None:
    upstreams = Upstreams("http://router:30000", PREFILL, DECODE)
    assert all(upstreams.pick("agent-7") == upstreams.pick("agent-7") for _ in range(5))
    picks = [upstreams.pick(f"agent-{i}") for i in range(600)]
    decode = Counter(t.url for t in picks)
    prefill = Counter(t.prefill.url for t in picks if t.prefill)
    assert set(decode) == set(DECODE) and min(decode.values()) > 150
    assert set(prefill) == {p.url for p in PREFILL} and min(prefill.values()) > 250
    assert upstreams.engines() == (*(p.url for p in PREFILL), *DECODE)


def test_bootstrap_fields_name_the_prefill_engine_and_a_fresh_room() -> None:
    first, second = bootstrap_fields(PREFILL[1]), bootstrap_fields(PREFILL[1])
    assert first["bootstrap_host"] == "10.0.0.2" and first["bootstrap_port"] == 8999
    assert first["bootstrap_room"] != second["bootstrap_room"]
    assert 0 <= int(first["bootstrap_room"]) < 2**63


@pytest.mark.parametrize(
    ("url", "port", "message"),
    [
        ("10.0.0.1:30000", "8998", "http"),
        ("http://10.0.0.1:30000", "x", "must be a number"),
        ("http://10.0.0.1:30000", "0", "between 1 and 65535"),
    ],
)
def test_bad_prefill_engines_are_refused_with_the_reason(url: str, port: str, message: str) -> None:
    with pytest.raises(BasinError, match=message):
        parse_prefill(url, port)


def test_prefill_and_decode_go_together() -> None:
    with pytest.raises(BasinError, match="both --prefill and --decode"):
        Settings(prefill=PREFILL)
    with pytest.raises(BasinError, match="both --prefill and --decode"):
        Settings(decode=DECODE)


def test_the_operator_s_environment_names_the_engines() -> None:
    env = {
        "BASIN_PREFILL_ENGINES": "http://10.0.0.1:30000 8998, http://10.0.0.2:30000 8999",
        "BASIN_DECODE_ENGINES": "http://10.0.1.1:30000,http://10.0.1.2:30000,http://10.0.1.3:30000",
    }
    settings = from_environment(env)
    assert settings.prefill == PREFILL and settings.decode == DECODE
    with pytest.raises(BasinError, match="URL BOOTSTRAP_PORT"):
        parse_prefill_list("http://10.0.0.1:30000")


def test_direct_addressing_without_known_engines_picks_nothing_until_pods_are_found() -> None:
    upstreams = Upstreams("http://router:30000", (), (), direct=True)
    assert upstreams.pick("s1") is None and upstreams.engines() == ()
    assert "found by the operator's selectors" in upstreams.describe()
    assert upstreams.update(PREFILL, DECODE)
    assert not upstreams.update(PREFILL, DECODE)  # nothing changed
    assert upstreams.pick("s1") is not None
    assert upstreams.update(PREFILL, ())  # every decode pod gone: no call can be placed
    assert upstreams.pick("s1") is None


def test_direct_addressing_needs_engines_or_selectors() -> None:
    with pytest.raises(BasinError, match="--direct needs the engines"):
        Settings(direct=True)
    with pytest.raises(BasinError, match="bootstrap port"):
        Settings(bootstrap_port=0)
    env = {
        "BASIN_DIRECT_ENGINES": "1",
        "BASIN_BOOTSTRAP_PORT": "9000",
        "BASIN_PREFILL_SELECTOR": "role=prefill",
        "BASIN_DECODE_SELECTOR": "role=decode",
    }
    settings = from_environment(env)
    assert settings.direct and settings.bootstrap_port == 9000
    assert Upstreams.of(settings).direct
