"""One merge of a `ClusterSpec` with the session settings: what each server of the cluster is asked to run.

A spec field left at ``None`` means "the session's value" (CLI > env > ini > default); this module is
the only place that rule is written. The command builder, the manager (the `PDCluster` it hands out)
and attach mode all read `AskedConfig`, so the header, the cluster object and the servers' flags cannot
disagree. What a started server really runs is read back and compared with it in ``verify.py``
(`verify.ObservedConfig`). It also applies the ``once`` rule of the owned-flags table across every source of one
server: a setting or spec field, the session's extra args, the spec's and the role's.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from typing import Literal

from pytest_pdserve.config import owned_flags
from pytest_pdserve.config.bounds import ATTENTION_BACKENDS
from pytest_pdserve.engines import cpu
from pytest_pdserve.errors import ClusterSpecError
from pytest_pdserve.spec import DEFAULT_BLOCK_SIZE, ClusterSpec

__all__ = ["AskedConfig", "SessionDefaults", "effective"]

Role = Literal["prefill", "decode"]
_SPEC_DEFAULTS = {f.name: f.default for f in fields(ClusterSpec)}


@dataclass(frozen=True)
class SessionDefaults:
    """The session settings a cluster needs (a narrow, pytest-free view of PDServeConfig)."""

    attention_backend: str | None = None
    vllm_serve_extra_args: tuple[str, ...] = ()
    gpu_memory_utilization: float | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool = True
    seed: int = 0
    api_key: str | None = None
    platform: str = "cpu"
    #: Where ``vllm_serve_extra_args`` came from, for errors (``VLLM_SERVE_EXTRA_ARGS (env)``).
    extra_args_source: str = "VLLM_SERVE_EXTRA_ARGS / --vllm-serve-extra-args / ini pdserve_vllm_serve_extra_args"
    #: Where ``attention_backend`` came from, for errors (``ATTENTION_BACKEND (env)``).
    attention_backend_source: str = "ATTENTION_BACKEND / --attention-backend / ini pdserve_attention_backend"


@dataclass(frozen=True)
class AskedConfig:
    """A spec merged with the session: what the servers are asked to run (their flags are built from it).

    What they really run is :class:`pytest_pdserve.running.verify.ObservedConfig`, read back after the start.
    """

    attention_backend: str | None
    block_size: int
    gpu_memory_utilization: float | None
    max_model_len: int | None
    enforce_eager: bool
    seed: int
    api_key: str | None
    platform: str
    prefill_extra_args: tuple[str, ...]
    decode_extra_args: tuple[str, ...]
    #: Each session value this cluster overrode, which won: ``max model len 4096 from ClusterSpec.max_model_len
    #: overrides the session's 2048`` (the ready line shows them).
    overrides: tuple[str, ...] = ()

    def extra_args(self, role: Role) -> tuple[str, ...]:
        """The extra args of *role*'s servers: the session's, then the spec's, then the role's."""
        return self.prefill_extra_args if role == "prefill" else self.decode_extra_args


def _check_backend_runs(backend: str | None, spec: ClusterSpec, session: SessionDefaults) -> None:
    """Refuse, before anything starts, a backend the platform would silently replace (issue 26): vLLM for CPU runs
    CPU_ATTN whatever it is asked and only the effective-config check after a full start would notice.
    The simulator follows the same rule (pytest_pdserve.engines.cpu), so this holds for both engines.

    :raises ClusterSpecError: naming the backend, where it came from and what runs instead.
    """
    if session.platform != "cpu" or backend is None or backend.strip().lower() == "auto":
        return
    running = cpu.running_attention_backend(backend)
    if backend.strip().upper() == running or backend.strip().upper() not in ATTENTION_BACKENDS:
        return  # an unknown name is the server's to refuse, in vLLM's words ("Unknown attention backend")
    where = "ClusterSpec.attention_backend" if spec.attention_backend is not None else session.attention_backend_source
    raise ClusterSpecError(
        f"attention backend {backend} (from {where}) does not run on the cpu platform: vLLM for CPU runs {running} "
        f"whatever it is asked, so the cluster would start and then fail the effective-config check. Use "
        f"{running} or auto here, or run this on a GPU platform (--pd-simulate-gpus=cuda:N for the simulator)"
    )


def _without(argv: tuple[str, ...], flag: str) -> tuple[tuple[str, ...], list[str]]:
    """``argv`` without every occurrence of owned flag ``flag`` (its value too); and the occurrences, as written."""
    drop: set[int] = set()
    shown: list[str] = []
    for hit in owned_flags.match(argv):
        if hit.owned.flag != flag:
            continue
        drop.add(hit.index)
        if "=" not in hit.token and hit.value is not None and hit.owned.takes_value:
            drop.add(hit.index + 1)
        shown.append(hit.shown)
    return tuple(a for i, a in enumerate(argv) if i not in drop), shown


def _once_hits(argv: tuple[str, ...]) -> dict[str, str]:
    """The ``once`` owned flags in ``argv``: flag -> as written (the last)."""
    return {hit.owned.flag: hit.shown for hit in owned_flags.match(argv) if hit.owned.policy == "once"}


def _cluster_gives(
    given: dict[str, list[owned_flags.Given]], sources: list[tuple[str, tuple[str, ...]]]
) -> dict[str, str]:
    """flag -> ``<value> from <source>`` for each ``once`` flag the cluster gives (its fields, then its extra args)."""
    found = {flag: f"{g[0].shown} from {g[0].source}" for flag, g in given.items()}
    for source, argv in sources:
        for flag, shown in _once_hits(argv).items():
            found[flag] = f"{shown!r} from {source}"
    return found


def effective(spec: ClusterSpec, session: SessionDefaults) -> AskedConfig:
    """Merge *spec* with *session*: a value the cluster gives beats the session's (:attr:`AskedConfig.overrides`
    names each one that did).

    The cluster's sources are its fields, ``extra_args`` and the role's extra args; the session's are its settings
    and ``VLLM_SERVE_EXTRA_ARGS`` (or, for this cluster only, ``ClusterSpec.vllm_serve_extra_args``). A ``once``
    flag given at both levels is the cluster's: the session's occurrence is left out of this cluster's argv, so vLLM
    never sees two. Two sources of one level that both give it stay an error (vLLM would silently take the last).

    :raises OwnedFlagError: a ``once`` owned flag reaches one server from two sources of the same level.
    :raises ClusterSpecError: an attention backend the platform would replace (:func:`_check_backend_runs`).
    """
    overrides: list[str] = []

    def pick(field: str, setting: str | None, shown: str) -> object:
        ours = getattr(spec, field)
        theirs = getattr(session, setting or field, None)
        if ours is None:
            return theirs
        if theirs is not None and theirs != ours:
            overrides.append(f"{shown} {ours!r} from ClusterSpec.{field} overrides the session's {theirs!r}")
        return ours

    backend = pick("attention_backend", None, "attention backend")
    _check_backend_runs(backend, spec, session)  # type: ignore[arg-type]
    block_size = pick("block_size", None, "block size")
    util = pick("gpu_memory_utilization", None, "gpu memory utilization")
    max_len = pick("max_model_len", None, "max model len")
    enforce_eager = pick("enforce_eager", None, "enforce eager")
    seed = pick("seed", None, "seed")

    session_args, args_source = session.vllm_serve_extra_args, session.extra_args_source
    if spec.vllm_serve_extra_args is not None:
        if spec.vllm_serve_extra_args != session_args:
            overrides.append(
                f"extra args {shlex.join(spec.vllm_serve_extra_args) or '(none)'} from "
                f"ClusterSpec.vllm_serve_extra_args instead of the session's {shlex.join(session_args) or '(none)'} "
                f"({session.extra_args_source})"
            )
        session_args, args_source = spec.vllm_serve_extra_args, "ClusterSpec.vllm_serve_extra_args"

    # The "once" flags: what each level gives (settings / spec fields that are set, then the extra-args sources).
    cluster_given: dict[str, list[owned_flags.Given]] = {}
    session_given: dict[str, list[owned_flags.Given]] = {}
    for owned in owned_flags.OWNED_FLAGS:
        if owned.policy != "once":
            continue
        field = owned.spec_field
        value = getattr(spec, field) if field is not None else None
        if field is not None and value is not None and value != _SPEC_DEFAULTS[field]:  # the default: "not set"
            cluster_given[owned.flag] = [owned_flags.Given(f"ClusterSpec.{owned.spec_field}", repr(value))]
        if owned.setting is not None and getattr(session, owned.setting, None) is not None:
            value = getattr(session, owned.setting)
            session_given[owned.flag] = [owned_flags.Given(f"the session setting {owned.setting}", repr(value))]
    per_role: dict[Role, tuple[str, ...]] = {}
    for role, own in (("prefill", spec.prefill_extra_args), ("decode", spec.decode_extra_args)):
        cluster_sources = [("ClusterSpec.extra_args", spec.extra_args), (f"ClusterSpec.{role}_extra_args", own)]
        owned_flags.check_once(cluster_given, cluster_sources)
        ours = _cluster_gives(cluster_given, cluster_sources)
        # A setting the cluster overrides is not the session's to give; one the session's extra args give is.
        session_level = {flag: g for flag, g in session_given.items() if flag not in ours}
        role_session_args = session_args
        for flag, shown in ours.items():
            role_session_args, dropped = _without(role_session_args, flag)
            for theirs in dropped:
                note = f"{flag}: {shown} overrides {theirs!r} from {args_source}"
                if note not in overrides:
                    overrides.append(note)
        owned_flags.check_once(session_level, [(args_source, role_session_args)])
        per_role[role] = (*role_session_args, *spec.extra_args, *own)  # type: ignore[index]
    # A setting the cluster's extra args override is not passed by pdserve; where only one role's extra args give
    # it, the other role still gets the setting (in its own argv, since pdserve's flags are the same for both roles).
    roles_own = {"prefill": _once_hits(spec.prefill_extra_args), "decode": _once_hits(spec.decode_extra_args)}
    common = _once_hits(spec.extra_args)
    for flag, field in (("--max-model-len", "max_model_len"), ("--gpu-memory-utilization", "gpu_memory_utilization")):
        value = max_len if field == "max_model_len" else util
        if getattr(spec, field) is not None or value is None:
            continue  # the spec field gives it (pdserve passes it), or nothing does
        given_in = [role for role in per_role if flag in common or flag in roles_own[role]]
        if not given_in:
            continue
        for role in given_in:
            source, shown_by = ("extra_args", common) if flag in common else (f"{role}_extra_args", roles_own[role])
            note = f"{flag}: {shown_by[flag]!r} from ClusterSpec.{source} overrides the session setting {field} {value}"
            if note not in overrides:
                overrides.append(note)
        for role in per_role:
            if role not in given_in:
                shown = str(value) if field == "max_model_len" else f"{value:g}"
                per_role[role] = (*per_role[role], flag, shown)
        if field == "max_model_len":
            max_len = None
        else:
            util = None
    return AskedConfig(
        attention_backend=backend,  # type: ignore[arg-type]
        block_size=block_size if block_size is not None else DEFAULT_BLOCK_SIZE,  # type: ignore[arg-type]
        gpu_memory_utilization=util,  # type: ignore[arg-type]
        max_model_len=max_len,  # type: ignore[arg-type]
        enforce_eager=bool(enforce_eager),
        seed=seed,  # type: ignore[arg-type]
        api_key=session.api_key,
        platform=session.platform,
        prefill_extra_args=per_role["prefill"],
        decode_extra_args=per_role["decode"],
        overrides=tuple(overrides),
    )
