from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture
def mooncake_slice() -> Path:
    return DATA / "mooncake_conversation_slice.jsonl"
