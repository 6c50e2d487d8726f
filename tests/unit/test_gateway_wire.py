"""The gateway's pure request helpers: what a call shows, session ids, the upstream rewrite, token counts."""

from __future__ import annotations

import orjson
import pytest

from basin_gateway.wire import (
    FAST_PATH_BYTES,
    BadInput,
    Body,
    answer_tokens,
    call_shape,
    parse_body,
    rewrite,
    session_of,
    stream_tokens,
    wire_priority,
)


def test_generate_shape_counts_ids_exactly_and_words_of_text() -> None:
    assert call_shape("/generate", {"input_ids": [1, 2, 3]}).prompt_tokens == 3
    assert call_shape("/generate", {"input_ids": [1, 2, 3]}).task == ""
    shape = call_shape("/generate", {"text": "fix the failing test", "stream": True})
    assert (shape.task, shape.prompt_tokens, shape.stream) == ("fix the failing test", 4, True)


def test_chat_shape_takes_the_first_user_message_as_the_task() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "you are an agent"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "build the"}, {"type": "text", "text": "thing"}],
            },
            {"role": "user", "content": "later"},
        ]
    }
    shape = call_shape("/v1/chat/completions", body)
    assert shape.task == "build the thing"
    assert shape.prompt_tokens == (1 + 4) + (1 + 3) + (1 + 1)  # a role word plus content words each


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/generate", {}, "exactly one of text and input_ids"),
        ("/generate", {"text": "a", "input_ids": [1]}, "exactly one"),
        ("/generate", {"text": ["a", "b"]}, "not a batch"),
        ("/generate", {"input_ids": [[1], [2]]}, "not a batch"),
        ("/generate", {"input_ids": "1 2"}, "list of token ids"),
        ("/generate", {"text": "a", "sampling_params": []}, "sampling_params must be an object"),
        ("/generate", {"text": "a", "sampling_params": {"custom_params": 3}}, "custom_params"),
        ("/generate", {"text": "a", "stream": "yes"}, "stream must be true or false"),
        ("/v1/chat/completions", {"messages": []}, "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "with a role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "string or a list"),
        ("/v1/completions", {"prompt": 7}, "prompt must be"),
        ("/v1/completions", {"prompt": "a", "custom_params": []}, "custom_params"),
    ],
)
def test_wrong_types_are_bad_input(route: str, body: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        call_shape(route, body)


def test_parse_body_refuses_malformed_json_and_non_objects() -> None:
    with pytest.raises(BadInput, match="invalid JSON"):
        parse_body(b"{oops")
    with pytest.raises(BadInput, match="JSON object"):
        parse_body(b"[1, 2]")


def test_session_id_from_header_then_body_then_user() -> None:
    assert session_of({"X-Session-ID": "h"}, "X-Session-ID", {"session_id": "b", "user": "u"}) == "h"
    assert session_of({}, "X-Session-ID", {"session_id": "b", "user": "u"}) == "b"
    assert session_of({}, "X-Session-ID", {"user": "u"}) == "u"
    assert session_of({}, "X-Session-ID", {}) is None
    assert session_of({"X-Agent": "a"}, "X-Agent", {}) == "a"  # BASIN_SESSION_HEADER
    with pytest.raises(BadInput, match="session_id must be"):
        session_of({}, "X-Session-ID", {"session_id": 5})


def test_rewrite_places_the_mark_where_sglang_reads_it() -> None:
    body = Body({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    native = orjson.loads(rewrite("/generate", body, "s1", "r1", 12.34, True))
    assert native["rid"] == "r1" and native["priority"] == 123
    assert native["sampling_params"]["custom_params"] == {"basin_session": "s1", "basin_lend": True}
    chat = orjson.loads(
        rewrite(
            "/v1/chat/completions",
            Body({"messages": [], "custom_params": {"mine": 1}}),
            "s2",
            "r2",
            None,
            False,
        )
    )
    assert "priority" not in chat
    assert chat["custom_params"] == {"mine": 1, "basin_session": "s2"}


def test_priority_is_an_int32() -> None:
    assert wire_priority(1.04) == 10
    assert wire_priority(1e12) == 2**31 - 1
    assert wire_priority(-1e12) == -(2**31)


def test_token_counts_from_answers_and_stream_tails() -> None:
    assert answer_tokens({"meta_info": {"prompt_tokens": 5, "completion_tokens": 3}}) == (5, 3, None)
    meta = {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 4}
    assert answer_tokens({"meta_info": meta}) == (5, 3, 4)
    assert answer_tokens({"usage": {"prompt_tokens": 4, "completion_tokens": 2}}) == (4, 2, None)
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
    assert answer_tokens({"usage": usage}) == (4, 2, 3)
    assert answer_tokens({"usage": {**usage, "prompt_tokens_details": None}}) == (4, 2, None)
    assert answer_tokens({"text": "x"}) is None
    tail = [
        b'data: {"meta_info": {"prompt_tokens": 9, "completion_tokens": 1}}\n\n',
        b'data: {"meta_info": {"prompt_tokens": 9, "com',
        b'pletion_tokens": 2}}\n\ndata: [DONE]\n\n',
    ]
    assert stream_tokens(tail) == ((9, 2, None), True)
    assert stream_tokens([b'data: {"choices": []}\n\n']) == (None, False)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_long_id_lists_are_counted_and_passed_on_unparsed(route: str) -> None:
    key = "input_ids" if route == "/generate" else "prompt"
    ids = list(range(FAST_PATH_BYTES))
    body = {"stream": True, key: ids, "sampling_params": {"max_new_tokens": 3}, "session_id": "s"}
    parsed = parse_body(orjson.dumps(body), route)
    assert parsed.ids_key == key and key not in parsed.fields
    assert call_shape(route, parsed).prompt_tokens == len(ids)
    out = orjson.loads(rewrite(route, parsed, "s", "r", 1.0, False))
    assert out[key] == ids and out["rid"] == "r" and out["stream"] is True


def test_the_fast_path_falls_back_on_anything_unusual() -> None:
    batch = orjson.dumps({"input_ids": [[1] * FAST_PATH_BYTES, [2]]})
    assert parse_body(batch, "/generate").ids_key is None  # a batch: parsed whole, then refused
    with pytest.raises(BadInput, match="not a batch"):
        call_shape("/generate", parse_body(batch, "/generate"))
    nested = orjson.dumps({"sampling_params": {"input_ids": [1]}, "input_ids": list(range(FAST_PATH_BYTES))})
    parsed = parse_body(nested, "/generate")
    assert call_shape("/generate", parsed).prompt_tokens == FAST_PATH_BYTES
    assert orjson.loads(parsed.encode()) == orjson.loads(nested)
    with pytest.raises(BadInput, match="invalid JSON"):
        parse_body(b'{"input_ids": [1, 2], "x": ' + b" " * FAST_PATH_BYTES, "/generate")
