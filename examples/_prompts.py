"""Deterministic prompts for the example suite.

Plain text built from a fixed word list, so it tokenizes to hundreds of tokens on any tokenizer (the
simulator's and the tiny Llama's) and spans several 128-token KV blocks.
"""

from __future__ import annotations

WORDS = (
    "red hat open source community cluster prefill decode cache block token transfer engine server "
    "request stream model kernel memory layer attention value key state scheduler worker proxy"
).split()


def make_prompt(n_words: int, seed: int = 0) -> str:
    """A deterministic prompt of ``n_words`` words (a different ``seed`` gives a different text)."""
    return " ".join(WORDS[(i * 7 + seed * 13 + i // len(WORDS)) % len(WORDS)] for i in range(n_words))
