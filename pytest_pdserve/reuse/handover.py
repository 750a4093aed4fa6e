"""The hand-over: what ``--pd-reuse`` does for the manager (`KeptClusters`), and the keeper it starts. [pytest-free]

`KeptClusters` is the manager's `Reuser` (`manager.py`): :meth:`~KeptClusters.find` claims and adopts a kept
cluster with a spec's fingerprint (or says why it starts a fresh one), :meth:`~KeptClusters.stop` stops a claimed
one through its keeper, and at the end :meth:`~KeptClusters.hand_over` hands claimed clusters back and gives every
healthy cluster this run started to one new keeper (:func:`keep`): their process groups, server tokens and lease
fds. pytest then disowns them (no stop, no lease release); the keeper (`keeper.py`) owns them from then on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from pytest_pdserve.cluster import EngineSetup, Reused, ServerHandle
from pytest_pdserve.common import created
from pytest_pdserve.common.child_env import child_environ
from pytest_pdserve.common.logfile import open_append
from pytest_pdserve.common.redaction import redact_argv, redact_env
from pytest_pdserve.config.effective import AskedConfig
from pytest_pdserve.errors import ReuseError
from pytest_pdserve.machine.lockfiles import want_file
from pytest_pdserve.reuse import protocol
from pytest_pdserve.reuse.adopt import adopt
from pytest_pdserve.reuse.client import Claim, find_reusable
from pytest_pdserve.reuse.dirs import ReuseOptions
from pytest_pdserve.reuse.fingerprint import fingerprint
from pytest_pdserve.reuse.protocol import KeeperOrder, OrderedCluster
from pytest_pdserve.reuse.state import KeptServer, KeptState
from pytest_pdserve.running.launch import ClusterLauncher, LaunchedCluster
from pytest_pdserve.running.process import ServerProcess
from pytest_pdserve.running.proctree import RUN_TOKEN_ENV, SERVER_TOKEN_ENV, isolated_argv, read_stat
from pytest_pdserve.running.verify import ObservedConfig
from pytest_pdserve.spec import ClusterSpec

__all__ = ["KeptClusters", "cluster_state", "keep"]

_KEEPER_START_TIMEOUT = 15.0
_MAX_KEEPER_LOG = 1 << 20


class KeptClusters:
    """``--pd-reuse`` for one manager: the clusters it claimed, the fingerprints it computed, what it reused."""

    def __init__(self, options: ReuseOptions) -> None:
        self.options = options
        #: Kept clusters this run attached to, for the end-of-run summary.
        self.reused: list[Reused] = []
        self._claims: dict[int, Claim] = {}  # id(LaunchedCluster) -> its claim
        self._wanted: dict[ClusterSpec, dict[str, str]] = {}  # what a fresh cluster of the spec is kept as

    def find(
        self,
        spec: ClusterSpec,
        setup: EngineSetup,
        model: str,
        asked: AskedConfig,
        placement: Mapping[str, object],
        launcher: ClusterLauncher,
        environ: Mapping[str, str],
    ) -> LaunchedCluster | None:
        """A kept cluster with this spec's fingerprint, claimed and checked; None: start a fresh one (said why).

        The fingerprint's environment is ``environ``, the copy a fresh cluster's servers would inherit
        (``running/start_env.py``), never one taken at configure: a variable set after it would otherwise be in
        the servers and not in the fingerprint, and the next run would reuse a cluster with another environment."""
        settings, report = launcher.settings, launcher.report
        wanted = fingerprint(
            spec=spec, defaults=settings.defaults, setup=setup, model=model, placement=placement,
            proxy_command=settings.proxy_command, environ=environ,
        )  # fmt: skip
        self._wanted[spec] = wanted
        claim, why = find_reusable(self.options.directory, wanted, spec.name, report, ttl=self.options.ttl)
        if claim is not None:
            try:
                running = adopt(claim, spec, api_key=asked.api_key, max_model_len=asked.max_model_len, report=report)
            except Exception as exc:
                claim.stop()
                why = f"kept cluster {claim.kept.id} failed its check ({exc}); stopped it"
            else:
                report(running.cluster.describe())
                assert running.cluster.reused is not None
                self.reused.append(running.cluster.reused)
                self._claims[id(running)] = claim
                return running
        if why is not None:
            report(f"pdserve: {spec.name}: starting a fresh cluster: {why}")
        return None

    def stop(self, running: LaunchedCluster) -> bool:
        """Have a claimed cluster's keeper stop it now (a test wants it gone: GPUs, memory); False: not claimed."""
        claim = self._claims.pop(id(running), None)
        if claim is None:
            return False
        claim.stop()
        return True

    def hand_over(self, running: Sequence[LaunchedCluster], launcher: ClusterLauncher) -> list[LaunchedCluster]:
        """The end of the run: claimed clusters go back to their keepers (or are stopped, if one died), healthy ones
        this run started go to a new keeper. Returns the rest, for the manager to stop as usual."""
        rest, keepable = [], []
        for r in running:
            claim = self._claims.pop(id(r), None)
            if claim is not None:
                if r.cluster.health.died is not None:
                    claim.stop()
                else:
                    claim.release()
                for s in r.cluster.servers:
                    s.close()
            elif self._keepable(r):
                keepable.append(r)
            else:
                rest.append(r)
        if keepable and not self._keep(keepable, launcher):
            rest += keepable
        return rest

    def _keepable(self, running: LaunchedCluster) -> bool:
        """A cluster this run started for a spec it fingerprinted, whose servers all still run."""
        return (
            running.cluster.spec in self._wanted
            and running.cluster.health.died is None
            and bool(running.processes)
            and all(p.returncode is None and p.pid is not None for p in running.processes)
        )

    def _keep(self, items: list[LaunchedCluster], launcher: ClusterLauncher) -> bool:
        """Hand ``items`` to a new keeper; False (said why) if it cannot take them: the caller stops them."""
        orders, states = [], []
        for r in items:
            plan = r.gpu_plan
            held = [*(plan.leases if plan is not None else ()), *r.port_leases]
            locks = tuple((fd, str(path)) for lease in held for fd, path in lease.locks)
            # Each lease has a want file: a run waiting for one of its GPUs or its fixed proxy port says so there.
            want = tuple(str(want_file(Path(path))) for _, path in locks)
            # On real CUDA the keeper unlocks a GPU only once nvidia-smi lists none of the kept servers on it.
            gated = launcher.gpus.gated_keys(plan) if plan is not None else None
            state = cluster_state(r, self._wanted[r.cluster.spec], launcher.run_token, release_gate=gated)
            states.append(state)
            orders.append(OrderedCluster(state.as_dict(), locks, want))
        try:
            pid = keep(
                orders, reuse_dir=self.options.directory, ttl=self.options.ttl, grace=launcher.orphan_grace(),
                run_token=launcher.run_token,
            )  # fmt: skip
        except ReuseError as exc:
            launcher.report(f"pdserve: reuse: {exc}; stopping the clusters instead")
            return False
        for r in items:
            launcher.disown(r)
        ids = ", ".join(s.id for s in states)
        launcher.report(
            f"pdserve: reuse: kept {ids} for the next --pd-reuse run (keeper pid {pid}; stops after "
            f"{self.options.ttl:g}s idle; `pdserve ls`, `pdserve stop --all`)"
        )
        return True


def _server_state(proc: ServerProcess, handle: ServerHandle, observed: ObservedConfig | None = None) -> KeptServer:
    info = read_stat(proc.pid) if proc.pid is not None else None
    command = handle.command
    return KeptServer(
        name=proc.name, role=handle.role, index=handle.index, url=handle.url, pid=proc.pid or -1,
        pgid=proc.pgid or -1, starttime=info.starttime if info is not None else -1, token=proc.server_token,
        log_path=str(proc.log_path), gpus=tuple(handle.gpus),
        rpc_dir=str(proc.rpc_dir) if proc.rpc_dir is not None else None,
        ports=dataclasses.astuple(handle.ports) if handle.ports is not None else None,
        argv=tuple(redact_argv(command.argv)) if command is not None else None,  # an --hf-token's value is a secret
        # The API key stays out of the file (the next run has it in its own settings: the fingerprint matched), and
        # so does any other secret a spec's env carries (HF_TOKEN, ...): shown as *** in the adopted command.
        env=redact_env({k: v for k, v in command.env.items() if k != "VLLM_API_KEY"}) if command else None,
        ready_seconds=handle.ready_seconds,
        # What /v1/models listed at the start: an attach that finds more (a LoRA adapter a test loaded) or less
        # refuses the cluster (see adopt, _changed_since_start).
        served_models=tuple(observed.served_models) if observed is not None else None,
        # ``/weight_info`` at the start: an RL-style test that set another weight version changed the weights.
        weight_version=observed.weight_version if observed is not None else None,
    )  # fmt: skip


def cluster_state(
    launched: LaunchedCluster,
    fingerprint_: Mapping[str, str],
    run_token: str,
    release_gate: Sequence[str] | None = None,
) -> KeptState:
    """What the keeper writes for one cluster (no secret: digests, URLs, pids, tokens, logs).

    ``release_gate``: the GPU UUIDs whose leases the keeper hands back only once nvidia-smi lists none of the
    servers on them (`gpu_plan.GpuPlanner.gated_keys`; None off real CUDA).
    """
    cluster = launched.cluster
    by_name = {p.name: p for p in launched.processes}
    at_start = cluster.observed or {}
    servers = [_server_state(by_name[h.name], h, at_start.get(h.name)) for h in (*cluster.prefill, *cluster.decode)]
    return KeptState(
        id=f"{launched.label}-{os.urandom(3).hex()}", spec_name=cluster.spec.name, label=launched.label,
        created=time.time() - cluster.started_seconds, fingerprint=dict(fingerprint_), run_token=run_token,
        engine=cluster.engine, model=cluster.model, vllm_version=cluster.vllm_version,
        block_size=cluster.block_size, attention_backend=cluster.attention_backend_asked,
        platform=cluster.platform, started_seconds=cluster.started_seconds,
        pd_ready_seconds=cluster.pd_ready_seconds, servers=tuple(servers),
        proxy=_server_state(by_name["proxy"], cluster.proxy),
        release_gate=tuple(release_gate) if release_gate else None,
    )  # fmt: skip


def keep(
    items: Sequence[OrderedCluster],
    *,
    reuse_dir: Path,
    ttl: float,
    grace: float,
    run_token: str,
) -> int:
    """Start one keeper for ``items``; returns its pid once it owns them.

    :raises ReuseError: it did not say it was ready (its log is ``<reuse_dir>/keeper.log``).
    """
    order = KeeperOrder(str(reuse_dir), ttl, grace, run_token, tuple(items))
    fds = sorted({fd for item in items for fd, _ in item.locks})
    env = child_environ(drop=(RUN_TOKEN_ENV, SERVER_TOKEN_ENV))  # no sweep hits it
    log_path = reuse_dir / "keeper.log"
    with contextlib.suppress(OSError):
        if log_path.stat().st_size > _MAX_KEEPER_LOG:  # every keeper appends to it: keep one old copy, not all
            created.replace_file(log_path, reuse_dir / "keeper.log.1")  # only over a copy pdserve made (created.py)
    try:
        log = open_append(log_path)
    except OSError as exc:
        raise ReuseError(f"the reuse keeper did not start: its log {log_path}: {exc.strerror or exc}") from None
    try:
        proc = subprocess.Popen(
            isolated_argv("pytest_pdserve.reuse.keeper"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            env=env, pass_fds=fds, start_new_session=True, close_fds=True,
        )  # fmt: skip
    finally:
        os.close(log)
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        proc.stdin.write(order.encode())
        proc.stdin.close()
        proc.wait(_KEEPER_START_TIMEOUT)  # the first process forks the keeper and exits at once
        line = _read_line_within(proc.stdout, _KEEPER_START_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait(5)
        raise ReuseError(f"the reuse keeper did not start: {exc}; see {log_path}") from None
    finally:
        proc.stdout.close()
    pid = protocol.parse_ready(line)
    if pid is None:
        raise ReuseError(f"the reuse keeper did not start: it said {line!r}; see {log_path}")
    return pid


def _read_line_within(stream: IO[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf and len(buf) < protocol.MAX_LINE and time.monotonic() < deadline:  # bounded: time, size
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
    return buf.partition(b"\n")[0].decode(errors="replace")
