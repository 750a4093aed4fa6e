"""In-process units of the simulator: tokenizer, block hashing, block pool."""

from __future__ import annotations

import pytest

from pytest_pdserve.sim import tokenizer
from pytest_pdserve.sim.engine import BlockPool, CacheFullError, chain_hashes


def test_tokenizer_is_stable_and_bounded() -> None:
    ids = tokenizer.encode("Red Hat is a company.")
    assert ids[0] == tokenizer.BOS_ID
    assert ids == tokenizer.encode("Red Hat is a company.")
    assert all(tokenizer.FIRST_REGULAR_ID <= t < tokenizer.VOCAB_SIZE for t in ids[1:])
    assert len(ids) == 7  # BOS, Red, _Hat, _is, _a, _company, .
    assert tokenizer.encode("x", add_bos=False) == ids[:0] + [tokenizer.encode("x")[1]]


def test_generation_is_a_function_of_model_and_prompt() -> None:
    a = tokenizer.generate_ids(b"m", [0, 5, 6], 8)
    assert a == tokenizer.generate_ids(b"m", [0, 5, 6], 8)
    assert a != tokenizer.generate_ids(b"other", [0, 5, 6], 8)
    assert a[:4] == tokenizer.generate_ids(b"m", [0, 5, 6], 4)
    assert tokenizer.decode(a).startswith(" ")
    assert len(set(map(tokenizer.token_text, range(tokenizer.VOCAB_SIZE)))) == tokenizer.VOCAB_SIZE


def test_chain_hashes_share_prefixes() -> None:
    root = b"r" * 16
    a = chain_hashes(root, list(range(40)), 16, include_partial=False)
    b = chain_hashes(root, list(range(32)) + [99] * 8, 16, include_partial=True)
    assert len(a) == 2
    assert len(b) == 3
    assert a == b[:2]
    assert chain_hashes(root, [1] + list(range(1, 40)), 16, False)[1] != a[1]  # a change early changes all


def test_block_pool_lru_eviction_and_reset() -> None:
    pool = BlockPool(3)
    first = pool.allocate(2)
    assert first == [1, 2]
    pool.cache(1, b"h1")
    pool.cache(2, b"h2")
    pool.release(first)
    assert pool.usage() == 0
    assert pool.lookup([b"h1", b"h2", b"h3"]) == [1, 2]
    pool.acquire([2])  # h2 in use and most recent: h1 is evicted first
    assert sorted(pool.allocate(2)) == [1, 3]
    assert pool.lookup([b"h1"]) == []
    with pytest.raises(CacheFullError):
        pool.allocate(1)
    assert pool.reset() is False  # blocks in use
    pool.release([1, 2, 3])
    assert pool.reset() is True
    assert pool.lookup([b"h2"]) == []
