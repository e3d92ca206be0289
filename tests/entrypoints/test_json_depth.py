"""The request-body depth scan (body_limit.json_too_deep) against the depth of what json.loads builds.

The scan never parses, so it is checked here on the cases that could fool a byte scanner: brackets
and quotes inside strings, escaped quotes and runs of backslashes, UTF-16/32 bodies (where a quote or
bracket byte can be half of another character), and bodies large enough to span several chunks.
"""
from __future__ import annotations

import json
import random

import pytest

from splitserve.entrypoints.openai.body_limit import MAX_JSON_DEPTH, json_too_deep


def depth(value) -> int:
    """Nesting depth of a parsed value, iteratively (the deep cases would overflow a recursion)."""
    best, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            best = max(best, d + 1)
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return best


def nest(d: int, leaf="x", kinds="[{") -> str:
    """Valid JSON nested exactly d deep (d >= 1), alternating arrays and objects."""
    opens = "".join('{"k": ' if kinds[i % len(kinds)] == "{" else "[" for i in range(d))
    closes = "".join("}" if kinds[i % len(kinds)] == "{" else "]" for i in reversed(range(d)))
    return opens + json.dumps(leaf) + closes


TRICKY_STRINGS = ['[[[[', '{{{{', '"', '\\', '\\"[[[', '\\\\', '\\\\"', '\\\\\\"[', '\\u005b\\u007b',
                  '"]]]"', 'ś\u0122\u015b\u017b\u0122', '\U0001f600[', '']


@pytest.mark.parametrize("limit", [1, 4, MAX_JSON_DEPTH])
def test_exact_at_the_limit(limit):
    for kinds in ("[", "{", "[{", "{["):
        for d in (1, limit - 1, limit, limit + 1, limit + 2):
            if d < 1:
                continue
            for leaf in TRICKY_STRINGS:
                text = nest(d, leaf, kinds)
                assert depth(json.loads(text)) == d
                assert json_too_deep(text.encode(), limit) is (d > limit), (d, limit, text[:80])


def random_json(rng: random.Random, budget: int, d: int = 0):
    r = rng.random()
    if budget <= 0 or r < 0.3:
        return rng.choice([rng.choice(TRICKY_STRINGS) * rng.randint(0, 3), 1, -2.5e10, None, True])
    items = [random_json(rng, budget // 3, d + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.65:
        return items
    return {rng.choice(TRICKY_STRINGS) + str(i): v for i, v in enumerate(items)}


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_random_documents_in_every_json_encoding(encoding):
    rng = random.Random(7)
    for _ in range(300):
        value = random_json(rng, rng.randint(1, 400))
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
        body = text.encode(encoding)
        assert depth(json.loads(body)) == depth(value)
        for limit in (1, 2, 3, 5):
            assert json_too_deep(body, limit) is (depth(value) > limit), (encoding, limit, text[:200])


def test_utf16_bytes_that_look_like_quotes_do_not_hide_depth():
    # U+0122 is b'"\x01' in UTF-16-LE: a byte scan of the raw body would think a string opens there.
    text = nest(MAX_JSON_DEPTH + 1, "\u0122" * 3)
    assert json_too_deep(text.encode("utf-16-le"))
    assert not json_too_deep(nest(MAX_JSON_DEPTH, "\u0122" * 3).encode("utf-16-le"))


def test_large_bodies_across_chunks():
    # ~3M brackets: several chunks of the cumulative sum, with the deep spot in the last one.
    wide = "[" + ",".join(["[]"] * 1_500_000)
    assert not json_too_deep((wide + "]").encode())
    deep_at_end = (wide + "," + nest(MAX_JSON_DEPTH) + "]").encode()
    assert json_too_deep(deep_at_end)  # depth 1 + MAX_JSON_DEPTH
    # 100000 levels, and a 5 MB string full of brackets that do not nest.
    assert json_too_deep(("[" * 100_000 + "]" * 100_000).encode())
    assert not json_too_deep(json.dumps({"prompt": "[{" * 2_500_000, "n": [[1]]}).encode())


def test_invalid_json_does_not_raise():
    for body in (b"", b"[" * 5000, b'"' * 7, b"\\" * 9, b"\xff\xfe\x00[[[[", b"{\"a\": [" * 100, bytes(range(256)) * 10):
        json_too_deep(body)
