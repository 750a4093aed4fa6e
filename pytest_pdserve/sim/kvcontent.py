"""What the simulated KV cache holds, so that decode computes with the KV it received (issue 44).

vLLM's decode computes a P/D request's first token from KV that prefill computed: if prefill served other
weights, or the transfer delivered the wrong blocks, decode's answer changes and nothing errors. The simulator
models that content, cheaply:

* every prompt position's KV is a 16-byte digest of the weights that computed it and of the prompt up to that
  position (:func:`kv_digests`); a hybrid model's Mamba state after a position is a digest of the same kind
  (:func:`state_digest`). The weights are the model plus every ``--hf-overrides`` key whose value differs from
  the checkpoint's (:func:`weights_key`): prefill started with ``{"rms_norm_eps": 0.01}`` computes other KV;
* a server keeps those digests in its KV blocks (``engine.BlockPool``), a prefix-cache hit reads them, the side
  channel sends them (one digest per token slot, zero-padded to the KV bytes of a token: :func:`pack`), and decode
  reads what arrived (:func:`unpack`) without checking it, as vLLM does;
* the output of a request is a function of the digests it computed with (:func:`context_digest`): the served
  weights, every prompt position's KV as used, and the Mamba state it started its last token from.

So a correct transfer reproduces the direct serve's output exactly, and every wrong one (other weights, blocks
from another prompt, blocks that never arrived) changes it. The digests do not depend on the block size or the
cache salt (vLLM's KV bytes do not either); the block hashes of the prefix cache do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

DIGEST = 16
"""Bytes of one token's KV digest (and of a Mamba state digest)."""
EMPTY = bytes(DIGEST)
"""The digest of a KV slot nothing was written to (fresh memory reads as zeros)."""


def weights_key(model: str, overrides: Mapping[str, Any] | None, config: Mapping[str, Any] | None) -> bytes:
    """The weights a server computes with: ``model`` plus the ``--hf-overrides`` that change the checkpoint.

    An override equal to the checkpoint's own value (``config``, its ``config.json``) changes nothing, as in vLLM.
    """
    changed = {k: v for k, v in (overrides or {}).items() if config is None or config.get(k, _MISSING) != v}
    text = json.dumps(changed, sort_keys=True, default=str) if changed else ""
    return hashlib.blake2b(f"{model}|{text}".encode(), digest_size=DIGEST).digest()


_MISSING = object()


def prefix_chain(tokens: Sequence[int]) -> list[bytes]:
    """``c[i]`` = a digest of ``tokens[: i + 1]`` (the content a position's KV depends on)."""
    out: list[bytes] = []
    parent = b""
    for token in tokens:
        parent = hashlib.blake2b(parent + token.to_bytes(4, "little"), digest_size=DIGEST).digest()
        out.append(parent)
    return out


def kv_digests(weights: bytes, chain: Sequence[bytes], start: int = 0, stop: int | None = None) -> list[bytes]:
    """The KV of positions ``start..stop`` as a server with ``weights`` computes them."""
    return [hashlib.blake2b(c, key=weights, digest_size=DIGEST).digest() for c in chain[start:stop]]


def state_digest(weights: bytes, chain: Sequence[bytes], last: int, start_state: bytes | None = None) -> bytes:
    """A hybrid model's Mamba state after position ``last``.

    ``start_state`` is the state the computation began from (a prefix-cache checkpoint or a received one): when it
    is what these weights compute for that point anyway, the result is the plain state after ``last``; a wrong one
    carries into every later state, as a real recurrent state does.
    """
    plain = hashlib.blake2b(chain[last] + b"|ssm", key=weights, digest_size=DIGEST).digest()
    if start_state is None:
        return plain
    return hashlib.blake2b(plain + start_state, key=weights, digest_size=DIGEST).digest()


def context_digest(weights: bytes, kv: Sequence[bytes], state: bytes | None) -> bytes:
    """What a request's output is computed from: the serving weights, each prompt position's KV as used, and (hybrid
    models) the Mamba state before the last prompt token."""
    h = hashlib.blake2b(key=weights, digest_size=DIGEST)
    h.update(b"".join(kv))
    if state is not None:
        h.update(b"|state|" + state)
    return h.digest()


def pack(blocks: Sequence[bytes], tokens_per_block: int, bytes_per_token: int) -> bytes:
    """The wire bytes of KV blocks: per token slot its digest, zero-padded to ``bytes_per_token``; slots a block does
    not hold (a partial last block) are zeros."""
    pad = bytes(max(0, bytes_per_token - DIGEST))
    out = []
    for content in blocks:
        digests = split(content)[:tokens_per_block]
        slots = [d[:bytes_per_token] + pad for d in digests]
        slots += [bytes(bytes_per_token)] * (tokens_per_block - len(digests))
        out.append(b"".join(slots))
    return b"".join(out)


def unpack(payload: bytes, num_blocks: int, tokens_per_block: int, bytes_per_token: int) -> list[bytes]:
    """The per-token digests in ``num_blocks`` blocks of wire bytes (``pack``'s inverse, empty slots included)."""
    width = min(DIGEST, bytes_per_token)
    return [
        payload[i * bytes_per_token : i * bytes_per_token + width].ljust(DIGEST, b"\0")
        for i in range(num_blocks * tokens_per_block)
    ]


def pack_state(state: bytes, size: int) -> bytes:
    """A Mamba state's wire bytes (``size``: the model's state bytes per request)."""
    return state[:size].ljust(size, b"\0")


def unpack_state(payload: bytes) -> bytes:
    return payload[:DIGEST].ljust(DIGEST, b"\0")


def split(content: bytes, count: int | None = None) -> list[bytes]:
    """A block's stored content (concatenated digests) as one digest per token; with ``count``, exactly that many
    (a block never written reads as empty slots)."""
    digests = [content[i : i + DIGEST] for i in range(0, len(content), DIGEST)]
    if count is None:
        return digests
    return (digests + [EMPTY] * count)[:count]
