"""The flags pdserve sets on every ``vllm serve`` itself: one table, one matching rule, every source.

Each :class:`OwnedFlag` says what pdserve does with the flag and what to use instead. Two policies:

* ``refused``: pdserve always sets it (or must control it, like the ports it leases); it is an error in
  any extra-args source, with a remedy naming the plugin option or `ClusterSpec` field.
* ``once``: pdserve sets it only when a setting or spec field asks for it; the extra args may give it
  instead, but the same server getting it from two places (a spec field and the extra args, or two
  extra-args sources) is an error naming both, never a silent "last one wins" (vLLM only warns).

The sources, checked by the same :func:`refuse` / :func:`check_once`: ``VLLM_SERVE_EXTRA_ARGS`` /
``--vllm-serve-extra-args`` / the ini key (at configure time, `settings.py`), `ClusterSpec.extra_args`,
``prefill_extra_args`` and ``decode_extra_args`` (when the spec is built, `spec.py`), and the merge of a
spec with the session (`effective.py`).

**The matching rule** (:func:`match`), written against vLLM 0.32's ``vllm serve`` parser
(``FlexibleArgumentParser``, ``allow_abbrev=True``; its option strings dumped and compared):

1. ``--flag value`` and ``--flag=value``.
2. Underscore spellings: vLLM turns ``_`` into ``-`` in everything between ``--`` and the first ``.``
   (``utils/argparse_utils.py``), so ``--max_model_len`` is ``--max-model-len``.
3. Dotted sub-keys: ``--kv-transfer-config.kv_role=x`` (and ``-ac.backend``) are merged by vLLM into the
   JSON flag before the base name, so the base name decides.
4. Abbreviations: argparse accepts any unique prefix, and some are very short (``--b`` is
   ``--block-size``, ``--ho`` is ``--host``, ``--te`` is ``--tensor-parallel-size``). Conservatively,
   **any prefix of an owned flag, at least one character after ``--``**, counts as that flag unless it
   is itself a complete vLLM flag (none is, today: :data:`COMPLETE_FLAGS_THAT_ARE_PREFIXES`). A prefix
   vLLM would find ambiguous is refused too; vLLM would reject it anyway.
5. Short aliases (``-tp``) likewise: the alias, a prefix of it (``-t``: argparse matches single-dash
   prefixes too), ``-tp=2`` and ``-tp2``.

The attention backend has a second spelling, ``--attention-config`` (``-ac``), whose ``backend`` key
sets it: that key (dotted or inside the JSON value) counts as ``--attention-backend``; the rest of
``--attention-config`` is the user's.

This module is pytest-free and imports no other module of the plugin but ``errors``: `spec.py` needs it, and the
settings table (which names each setting's flag / env var / ini key) sits above `spec.py`. The remedies naming a
plugin option are therefore spelled out in :data:`SETTING_REMEDIES`, which tests/project/test_imports.py keeps equal to
``setting_table.remedy`` (the one rule that derives them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pytest_pdserve.errors import OwnedFlagError

__all__ = [
    "OWNED_ENV",
    "OWNED_FLAGS",
    "SETTING_REMEDIES",
    "Hit",
    "OwnedFlag",
    "check_env",
    "check_once",
    "match",
    "refuse",
]

Policy = Literal["refused", "once"]


@dataclass(frozen=True)
class OwnedFlag:
    """One flag pdserve sets itself.

    :param flag: vLLM's canonical spelling.
    :param policy: ``refused`` (never from the user) or ``once`` (the user may set it in one place).
    :param why: why pdserve owns it.
    :param setting: the settings-table name whose flag / env var / ini key sets it instead, if any.
    :param spec_field: the `ClusterSpec` field that sets it instead, if any.
    :param instead: a note on what to do instead (the only remedy when neither a setting nor a field sets it).
    :param aliases: other long spellings of the same option (``--no-...``).
    :param short: vLLM's short aliases (``-tp``).
    :param takes_value: False for boolean flags (no value follows).
    :param secret: its value is never shown (the API key).
    """

    flag: str
    policy: Policy
    why: str
    setting: str | None = None
    spec_field: str | None = None
    instead: str | None = None
    aliases: tuple[str, ...] = ()
    short: tuple[str, ...] = ()
    takes_value: bool = True
    secret: bool = False

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)


#: How to set each setting an owned flag names, exactly as ``setting_table.remedy(name)`` spells it (flag / env var /
#: ini key). A copy, because the settings table imports this module through `spec.py` (an import cycle otherwise);
#: tests/project/test_imports.py fails when the two differ.
SETTING_REMEDIES: Mapping[str, str] = {
    "attention_backend": "--attention-backend / ATTENTION_BACKEND / pdserve_attention_backend",
    "api_key": "--pd-api-key / PDSERVE_API_KEY / pdserve_api_key",
    "block_size": "--pd-block-size / PDSERVE_BLOCK_SIZE / pdserve_block_size",
    "seed": "--pd-seed / PDSERVE_SEED / pdserve_seed",
    "enforce_eager": "--pd-enforce-eager / --no-pd-enforce-eager / PDSERVE_ENFORCE_EAGER / pdserve_enforce_eager",
    "model": "--pd-model / PDSERVE_MODEL / pdserve_model",
    "max_model_len": "--pd-max-model-len / PDSERVE_MAX_MODEL_LEN / pdserve_max_model_len",
    "gpu_memory_utilization": "--pd-gpu-memory-utilization / GPU_MEMORY_UTILIZATION / pdserve_gpu_memory_utilization",
}

_GPUS_LEASED = "pdserve leases prefill_tp / decode_tp GPUs per server, and more would use GPUs it did not lease"

#: Every flag the command builder sets, plus those that would silently undo what it set up (ports, GPUs, the model).
OWNED_FLAGS: tuple[OwnedFlag, ...] = (
    OwnedFlag("--host", "refused", "every server binds 127.0.0.1 only",
              instead="for servers elsewhere use attach mode: --pd-prefill-url / --pd-decode-url"),
    OwnedFlag("--port", "refused", "pdserve leases every port a server binds"),
    OwnedFlag("--uds", "refused", "servers listen on a leased 127.0.0.1 TCP port, where readiness is checked"),
    OwnedFlag("--kv-transfer-config", "refused", "it carries the P/D roles (kv_producer / kv_consumer)",
              spec_field="kv_connector / kv_buffer_device / kv_load_failure_policy / kv_connector_extra_config"),
    OwnedFlag("--attention-backend", "refused", "prefill and decode must run the same backend",
              setting="attention_backend", spec_field="attention_backend"),
    OwnedFlag("--tensor-parallel-size", "refused", _GPUS_LEASED, spec_field="prefill_tp / decode_tp",
              short=("-tp",)),
    OwnedFlag("--pipeline-parallel-size", "refused", _GPUS_LEASED, short=("-pp",)),
    OwnedFlag("--data-parallel-size", "refused", _GPUS_LEASED, spec_field="num_prefill / num_decode",
              short=("-dp",)),
    OwnedFlag("--data-parallel-size-local", "refused", _GPUS_LEASED, spec_field="num_prefill / num_decode",
              short=("-dpl",)),
    OwnedFlag("--api-key", "refused", "a secret on argv is visible to every local user (ps)", setting="api_key",
              secret=True),
    OwnedFlag("--block-size", "refused", "the cluster's block size drives the KV-transfer arithmetic of the checks",
              setting="block_size", spec_field="block_size"),
    OwnedFlag("--seed", "refused", "pdserve always sets it", setting="seed"),
    OwnedFlag("--enforce-eager", "refused", "pdserve sets it from a setting", setting="enforce_eager",
              aliases=("--no-enforce-eager",), takes_value=False),
    OwnedFlag("--model", "refused", "pdserve passes the model itself", setting="model", spec_field="model"),
    OwnedFlag("--config", "refused", "pdserve cannot check the flags a config file sets (--host, --port, ...)",
              instead="give the flags themselves in the extra args"),
    OwnedFlag("--max-model-len", "once", "pdserve sets it from a setting or spec field",
              setting="max_model_len", spec_field="max_model_len"),
    OwnedFlag("--gpu-memory-utilization", "once", "pdserve sets it from a setting or spec field",
              setting="gpu_memory_utilization", spec_field="gpu_memory_utilization"),
    OwnedFlag("--trust-remote-code", "once", "pdserve sets it from a spec field", spec_field="trust_remote_code",
              aliases=("--no-trust-remote-code",), takes_value=False),
    OwnedFlag("--enable-prefix-caching", "once", "pdserve sets it from a spec field",
              spec_field="enable_prefix_caching", aliases=("--no-enable-prefix-caching",), takes_value=False),
    OwnedFlag("--mamba-cache-mode", "once", "pdserve sets it from a spec field", spec_field="mamba_cache_mode"),
)  # fmt: skip

#: vLLM flags that are a prefix of an owned flag but are complete flags of their own (rule 4's exception).
#: Empty for vLLM 0.32 (checked against its 430 option strings); add one here if a vLLM release adds one.
COMPLETE_FLAGS_THAT_ARE_PREFIXES: frozenset[str] = frozenset()

_ATTENTION_CONFIG = ("--attention-config", "-ac")
_BY_FLAG: Mapping[str, OwnedFlag] = {s: f for f in OWNED_FLAGS for s in f.spellings}
_BACKEND = _BY_FLAG["--attention-backend"]

#: Environment variables the command builder sets, which ClusterSpec.env / prefill_env / decode_env may not
#: replace (name -> what to use instead).
OWNED_ENV: Mapping[str, str] = {
    "VLLM_API_KEY": "--pd-api-key / PDSERVE_API_KEY / pdserve_api_key (a key the plugin does not know makes "
    "every readiness check fail with 401)",
    "VLLM_HOST_IP": "nothing: servers use 127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "nothing: the NIXL side channel binds 127.0.0.1 (attach mode for servers "
    "on other hosts)",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "nothing: the port is leased",
    "VLLM_PORT": "nothing: the VLLM_PORT window is leased",
    "VLLM_ATTENTION_BACKEND": "ClusterSpec.attention_backend or --attention-backend / ATTENTION_BACKEND",
}


@dataclass(frozen=True)
class Hit:
    """One owned flag found in an argv.

    :param owned: the table entry.
    :param index: position of the flag in the argv.
    :param token: the flag as written (``--hos=0.0.0.0``).
    :param value: its value (after ``=`` or the next element), None for a boolean flag.
    """

    owned: OwnedFlag
    index: int
    token: str
    value: str | None

    @property
    def shown(self) -> str:
        """The flag and its value as the user wrote them (a secret value masked)."""
        if self.owned.secret and self.value is not None:
            return f"{self.token.split('=', 1)[0]}{'=' if '=' in self.token else ' '}***"
        if "=" in self.token or self.value is None:
            return self.token
        return f"{self.token} {self.value}"

    @property
    def spelled_as(self) -> str:
        """``--hos (read by vLLM as --host)`` when the spelling differs from the canonical flag."""
        written = self.token.split("=", 1)[0]
        if written in self.owned.spellings:
            return written
        return f"{written} (read by vLLM as {self.owned.flag})"


def _normalise(key: str) -> str:
    """vLLM's rule: ``_`` -> ``-`` between the leading ``--`` and the first ``.``."""
    base, dot, rest = key[2:].partition(".")
    return "--" + base.replace("_", "-") + dot + rest


def _long_owner(base: str) -> OwnedFlag | None:
    if base in _BY_FLAG:
        return _BY_FLAG[base]
    if len(base) <= 2 or base in COMPLETE_FLAGS_THAT_ARE_PREFIXES:
        return None
    for spelling, owned in _BY_FLAG.items():
        if spelling.startswith(base):
            return owned
    return None


def _short_owner(base: str) -> OwnedFlag | None:
    if len(base) < 2:
        return None
    for owned in OWNED_FLAGS:
        for alias in owned.short:
            if alias.startswith(base) or (base.startswith(alias) and base[len(alias) :].isdigit()):
                return owned
    return None


def _sets_backend(base: str, sub: str, value: str | None) -> bool:
    """``--attention-config`` (or an abbreviation / ``-ac``) setting its ``backend`` key."""
    is_config = (base.startswith("--attention-c") and "--attention-config".startswith(base)) or base == "-ac"
    if not is_config:
        return False
    if sub:
        return sub.rstrip("+").split(".")[0] == "backend"
    try:
        parsed = json.loads(value or "")
    except ValueError:
        return False
    return isinstance(parsed, dict) and "backend" in parsed


def match(argv: Sequence[str]) -> Iterator[Hit]:
    """Every owned flag in *argv*, by the rule in the module docstring (in argv order)."""
    for i, token in enumerate(argv):
        if not token.startswith("-") or token in ("-", "--") or token[1:2].isdigit():
            continue
        key, eq, inline = token.partition("=")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if key.startswith("--"):
            key = _normalise(key)
            base, _, sub = key.partition(".")
            owned = _long_owner(base)
        else:
            base, _, sub = key.partition(".")
            owned = _short_owner(base)
        value = inline if eq else nxt
        if owned is None and _sets_backend(base, sub, value):
            owned = _BACKEND
        if owned is None:
            continue
        if not eq and not owned.takes_value and not sub:
            value = None
        yield Hit(owned, i, token, value)


def _remedy(owned: OwnedFlag) -> str:
    """What to use instead, naming the plugin option (flag / env var / ini key) and the ClusterSpec field;
    empty when nothing overrides it."""
    parts = []
    if owned.spec_field is not None:
        fields = " / ".join(f"ClusterSpec.{f.strip()}" for f in owned.spec_field.split("/"))
        parts.append(fields)
    if owned.setting is not None:
        parts.append(SETTING_REMEDIES[owned.setting])
    return " or ".join(parts)


def _advice(owned: OwnedFlag) -> str:
    remedy = _remedy(owned)
    text = f"use {remedy} instead" if remedy else "it cannot be overridden"
    return f"{text} ({owned.instead})" if owned.instead else text


def refuse(argv: Sequence[str], source: str) -> None:
    """Raise `OwnedFlagError` for the first ``refused`` owned flag in *argv* (from *source*, e.g.
    ``VLLM_SERVE_EXTRA_ARGS (env)`` or ``ClusterSpec.extra_args``)."""
    for hit in match(argv):
        if hit.owned.policy == "refused":
            raise OwnedFlagError(
                f"{hit.spelled_as} in {source} ({hit.shown!r}) is a flag pdserve owns, because "
                f"{hit.owned.why}; {_advice(hit.owned)}"
            )


@dataclass(frozen=True)
class Given:
    """A ``once`` flag's value as one source gave it, for the "given twice" error."""

    source: str
    shown: str


def check_once(given: Mapping[str, Sequence[Given]], sources: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Raise `OwnedFlagError` when a ``once`` flag reaches one server from two places.

    :param given: flag -> what the settings / spec fields give it (already merged: at most one entry each).
    :param sources: ``(source, argv)`` for each extra-args source of that server.
    """
    seen: dict[str, list[Given]] = {flag: list(g) for flag, g in given.items()}
    for source, argv in sources:
        for hit in match(argv):
            if hit.owned.policy == "once":
                seen.setdefault(hit.owned.flag, []).append(Given(source, repr(hit.shown)))
    for flag, places in seen.items():
        if len(places) > 1:
            owned = _BY_FLAG[flag]
            both = " and ".join(f"{g.shown} from {g.source}" for g in places)
            raise OwnedFlagError(
                f"{flag} is given twice for one server: {both}; give it once, with {_remedy(owned)} "
                "or in one extra-args source (vLLM would silently take the last one)"
            )


def check_env(env: Mapping[str, str], source: str, *, allowed: Callable[[str], bool] = lambda _k: False) -> None:
    """Raise `OwnedFlagError` for an environment variable pdserve sets itself (``ClusterSpec.env`` ...)."""
    for key in env:
        if key in OWNED_ENV and not allowed(key):
            raise OwnedFlagError(f"{key} in {source} is set by pdserve itself; use {OWNED_ENV[key]} instead")
