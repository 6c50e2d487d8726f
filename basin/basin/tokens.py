"""A deterministic word tokenizer shared by the replay client and the engine emulator.

One whitespace-separated word is one token, so a client that sends N words sends exactly N tokens and
the emulator needs no model vocabulary. Token ids `FIRST_ID ≤ id < VOCAB_SIZE` spell as `w<id>`; any
other word maps to an id by its CRC-32, so arbitrary text tokenizes the same way in every process.
Ids stay below 32,000, valid in every common model vocabulary, so `--api sglang` replays (which send
`input_ids`) also work against a real SGLang deployment.

Prefix reuse comes from content: `page_keys` chains a hash over each full page of token ids, so two
prompts share a page key exactly when they share every token up to the end of that page.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np

VOCAB_SIZE = 32_000
FIRST_ID = 100  # below: special tokens in most vocabularies
_MEMO_LIMIT = 1 << 20

_WORDS = [f"w{i}" for i in range(VOCAB_SIZE)]  # the spelling of every id, so decode is one join
# Every vocabulary word is known up front, so encoding text made by `decode` is one lookup per word;
# other words are memoized as they are met (up to a bound).
_ids: dict[str, int] = {_WORDS[i]: i for i in range(FIRST_ID, VOCAB_SIZE)}


def _word_id(word: str) -> int:
    if word[0] == "w" and word[1:].isdigit():
        value = int(word[1:])
        if FIRST_ID <= value < VOCAB_SIZE:
            return value
    return FIRST_ID + zlib.crc32(word.encode()) % (VOCAB_SIZE - FIRST_ID)


def encode(text: str) -> list[int]:
    """Token ids of `text`, one per whitespace-separated word."""
    words = text.split()
    try:
        return [_ids[word] for word in words]  # the common case: text a client made with `decode`
    except KeyError:
        pass
    out = []
    for word in words:
        value = _ids.get(word)
        if value is None:
            value = _word_id(word)
            if len(_ids) < _MEMO_LIMIT:
                _ids[word] = value
        out.append(value)
    return out


def decode(ids: Sequence[int]) -> str:
    """Text whose `encode` gives back `ids` (for ids in the vocabulary)."""
    words = _WORDS
    return " ".join([words[i] if 0 <= i < VOCAB_SIZE else f"w{i}" for i in ids])


def common_prefix(a: Iterable[int], b: Iterable[int]) -> int:
    """Length of the longest common prefix of two sequences (tokens, page keys, block hashes)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def page_keys(ids: Sequence[int], page_tokens: int) -> tuple[int, ...]:
    """One key per full page: a hash of the page's tokens chained with the previous page's key."""
    keys = []
    previous = 0
    for start in range(0, len(ids) - page_tokens + 1, page_tokens):
        previous = hash((previous, tuple(ids[start : start + page_tokens])))
        keys.append(previous)
    return tuple(keys)


def filler(rng: np.random.Generator, count: int) -> list[int]:
    """`count` random token ids: new content that no other prompt shares (with overwhelming odds)."""
    return rng.integers(FIRST_ID, VOCAB_SIZE, size=max(count, 0)).tolist()


def shared_prefix(workload: str, count: int) -> list[int]:
    """The first `count` ids of `workload`'s shared prefix (its system prompt and tool schema): the same
    ids in every session and process, so the engine's prefix cache shares them across sessions."""
    return filler(np.random.default_rng(zlib.crc32(f"shared-prefix:{workload}".encode())), count)


def output_ids(seed: int, count: int) -> list[int]:
    """The emulator's deterministic output: `count` ids derived from `seed` (e.g. the prompt's hash)."""
    return filler(np.random.default_rng(seed & 0xFFFFFFFFFFFFFFFF), count)
