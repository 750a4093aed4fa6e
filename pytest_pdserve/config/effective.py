"""One merge of a `ClusterSpec` with the session settings: what each server of the cluster is asked to run.

A spec field left at ``None`` means "the session's value" (CLI > env > ini > default); this module is
the only place that rule is written. The command builder, the manager (the `PDCluster` it hands out)
and attach mode all read `AskedConfig`, so the header, the cluster object and the servers' flags cannot
disagree. What a started server really runs is read back and compared with it in ``verify.py``
(`verify.ObservedConfig`). It also applies the ``once`` rule of the owned-flags table across every source of one
server: a setting or spec field, the session's extra args, the spec's and the role's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from pytest_pdserve.config import owned_flags
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
    from pytest_pdserve.sim.cli import ATTENTION_BACKENDS  # vLLM's AttentionBackendEnum names

    running = cpu.running_attention_backend(backend)
    if backend.strip().upper() == running or backend.strip().upper() not in ATTENTION_BACKENDS:
        return  # an unknown name is the server's to refuse, in vLLM's words ("Unknown attention backend")
    where = "ClusterSpec.attention_backend" if spec.attention_backend is not None else session.attention_backend_source
    raise ClusterSpecError(
        f"attention backend {backend} (from {where}) does not run on the cpu platform: vLLM for CPU runs {running} "
        f"whatever it is asked, so the cluster would start and then fail the effective-config check. Use "
        f"{running} or auto here, or run this on a GPU platform (--pd-simulate-gpus=cuda:N for the simulator)"
    )


def effective(spec: ClusterSpec, session: SessionDefaults) -> AskedConfig:
    """Merge *spec* with *session*.

    :raises OwnedFlagError: a ``once`` owned flag reaches one server from two places.
    :raises ClusterSpecError: an attention backend the platform would replace (:func:`_check_backend_runs`).
    """
    backend = spec.attention_backend if spec.attention_backend is not None else session.attention_backend
    _check_backend_runs(backend, spec, session)
    block_size = spec.block_size if spec.block_size is not None else session.block_size
    util = spec.gpu_memory_utilization if spec.gpu_memory_utilization is not None else session.gpu_memory_utilization
    max_len = spec.max_model_len if spec.max_model_len is not None else session.max_model_len
    # What the settings and spec fields make pdserve pass itself, for the table's "once" flags.
    given: dict[str, list[owned_flags.Given]] = {}
    for owned in owned_flags.OWNED_FLAGS:
        if owned.policy != "once":
            continue
        field = owned.spec_field
        value = getattr(spec, field) if field is not None else None
        if field is not None and value is not None and value != _SPEC_DEFAULTS[field]:  # the default: "not set"
            given[owned.flag] = [owned_flags.Given(f"ClusterSpec.{owned.spec_field}", repr(value))]
        elif owned.setting is not None and getattr(session, owned.setting, None) is not None:
            value = getattr(session, owned.setting)
            given[owned.flag] = [owned_flags.Given(f"the session setting {owned.setting}", repr(value))]
    per_role: dict[Role, tuple[str, ...]] = {}
    for role, own in (("prefill", spec.prefill_extra_args), ("decode", spec.decode_extra_args)):
        sources = [
            (session.extra_args_source, session.vllm_serve_extra_args),
            ("ClusterSpec.extra_args", spec.extra_args),
            (f"ClusterSpec.{role}_extra_args", own),
        ]
        owned_flags.check_once(given, sources)
        per_role[role] = (*session.vllm_serve_extra_args, *spec.extra_args, *own)  # type: ignore[index]
    return AskedConfig(
        attention_backend=backend,
        block_size=block_size if block_size is not None else DEFAULT_BLOCK_SIZE,
        gpu_memory_utilization=util,
        max_model_len=max_len,
        enforce_eager=session.enforce_eager,
        seed=session.seed,
        api_key=session.api_key,
        platform=session.platform,
        prefill_extra_args=per_role["prefill"],
        decode_extra_args=per_role["decode"],
    )
