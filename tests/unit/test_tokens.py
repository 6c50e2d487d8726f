"""The shared word tokenizer: exact token counts, round trips, content-defined page keys."""

import subprocess
import sys

import numpy as np

from basin import tokens


def test_one_word_is_one_token_and_ids_round_trip() -> None:
    ids = tokens.output_ids(7, 500)
    assert all(tokens.FIRST_ID <= i < tokens.VOCAB_SIZE for i in ids)
    assert tokens.encode(tokens.decode(ids)) == ids
    assert len(tokens.encode("any  words\tat all\n here")) == 5
    assert tokens.encode("hello world") == tokens.encode("hello world")


def test_page_keys_share_exactly_the_common_full_pages() -> None:
    rng = np.random.default_rng(0)
    base = tokens.filler(rng, 64 * 10 + 5)
    extended = base + tokens.filler(rng, 300)
    changed = base.copy()
    changed[64 * 4 + 3] += 1  # a token in page 4
    a, b, c = (tokens.page_keys(x, 64) for x in (base, extended, changed))
    assert len(a) == 10 and b[:10] == a
    assert c[:4] == a[:4] and all(x != y for x, y in zip(c[4:], a[4:], strict=True))


def test_page_keys_are_the_same_in_every_process() -> None:
    """Keys hash tuples of ints, which Python hashes the same regardless of PYTHONHASHSEED."""
    code = "from basin import tokens; print(tokens.page_keys(tokens.output_ids(3, 640), 64))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert runs == {str(tokens.page_keys(tokens.output_ids(3, 640), 64))}
