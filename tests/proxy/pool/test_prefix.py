"""The prompt-cache estimate: chained block hashes of a prompt and each upstream's index."""

from __future__ import annotations

import pytest

from llmproxy.proxy.pool.prefix import BLOCK_CHARS, PrefixIndex, block_hashes, prompt_text


def test_a_hash_stands_for_the_whole_prefix_up_to_its_block() -> None:
    a = "x" * BLOCK_CHARS * 3
    b = "y" * BLOCK_CHARS + "x" * BLOCK_CHARS * 2  # same 2nd and 3rd blocks, other 1st
    assert len(block_hashes(a)) == 3 and len(block_hashes(a + "partial")) == 3
    assert block_hashes(a)[:2] == block_hashes(a[: BLOCK_CHARS * 2])
    assert not set(block_hashes(a)) & set(block_hashes(b))
    assert block_hashes("short") == []


def test_the_index_matches_leading_blocks_and_forgets_the_least_recent() -> None:
    index = PrefixIndex(max_blocks=4)
    first = block_hashes("a" * BLOCK_CHARS * 3)
    index.add(first)
    assert index.match(block_hashes("a" * BLOCK_CHARS * 5)) == 3
    assert index.match(block_hashes("b" + "a" * BLOCK_CHARS * 5)) == 0  # differs in block 1
    index.add(block_hashes("c" * BLOCK_CHARS * 2))  # 5 blocks > 4: the oldest goes
    assert len(index) == 4 and index.match(first) == 0  # its first block went


@pytest.mark.parametrize(
    ("route", "body", "text"),
    [
        (
            "/infill",
            {
                "input_extra": [{"filename": "a.py", "text": "A"}],
                "input_prefix": "P",
                "prompt": "Q",
                "input_suffix": "S",  # after the cursor: changes with every keystroke's line
            },
            "a.pyAPQ",
        ),
        ("/completion", {"prompt": "abc"}, "abc"),
        ("/v1/completions", {"prompt": ["ab", "c"]}, "abc"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None),
        ("/completion", ["not an object"], ""),
    ],
)
def test_prompt_text_per_route(route: str, body: object, text: str | None) -> None:
    got = prompt_text(route, body)
    if text is None:  # chat: its messages, serialized
        assert '"content": "hi"' in got
    else:
        assert got == text
