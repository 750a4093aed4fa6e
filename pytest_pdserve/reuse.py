"""Keep clusters between runs (``--pd-reuse``): fingerprints, kept-cluster state, claims, hand-over. [pytest-free]

The inner loop of a test author is "edit a test, run pytest": with ``--pd-reuse`` the servers' start (a minute
or more) is paid once. How:

* **Keep.** When a reuse run ends, :func:`keep` hands every cluster it started (and that is still healthy) to one
  :mod:`keeper <pytest_pdserve.keeper>` process: their process groups, server tokens and lease fds. pytest then
  disowns them (no stop, no lease release) and ends; the keeper owns them from then on.
* **Fingerprint.** Each kept cluster records a :func:`fingerprint`: one digest per component of its effective
  configuration (every `ClusterSpec` field, every session setting, the engine's command and version, the
  model, the GPU placement settings, the proxy command, and the environment variables the servers read). Only
  digests are written, so no secret reaches the state file; differing *names* say why a cluster was not reused.
* **Attach.** A later reuse run that needs a spec first looks for a kept cluster with the same fingerprint
  (:func:`find_reusable`): it *claims* it (one run at a time), checks every server is the process that was
  kept (pid and start time) and answers ``/health``, resets the prefix caches (``POST /reset_prefix_cache``)
  and hands it out. Anything else starts a fresh cluster and says why.
* **Isolation.** Per-test cache salts are fresh each session (``--pd-cache-salt``), and the reset at attach
  empties the caches a previous run warmed. A keeper that is gone is noticed by the next run
  (:func:`list_kept`), which stops whatever of its servers is left and removes its state.

The state lives in a private directory (:func:`ensure_reuse_dir`: ours, mode 0700, not writable by others);
every state file is read without following links and parsed defensively, and a file that does not parse is
removed and named, never trusted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import select
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pytest_pdserve.errors import PDServeError, ReuseError
from pytest_pdserve.gpu_probe import wait_for_gate
from pytest_pdserve.keeper import STATE_SUFFIX, gone_server, is_wanted, peer_uid_pid
from pytest_pdserve.lockfiles import want
from pytest_pdserve.logfile import open_append, write_replace
from pytest_pdserve.paths import ensure_dir
from pytest_pdserve.proctree import (
    RUN_TOKEN_ENV,
    SERVER_TOKEN_ENV,
    alive_as,
    isolated_argv,
    listens_on,
    read_stat,
    terminate,
)
from pytest_pdserve.redaction import redact_argv, redact_env
from pytest_pdserve.rpc_dirs import remove_rpc_dir
from pytest_pdserve.tiny_model import cache_base

if TYPE_CHECKING:
    from pytest_pdserve.cluster import EngineSetup
    from pytest_pdserve.effective import SessionDefaults
    from pytest_pdserve.launch import LaunchedCluster
    from pytest_pdserve.spec import ClusterSpec
    from pytest_pdserve.verify import ObservedConfig

__all__ = [
    "Claim",
    "ReuseOptions",
    "KeptCluster",
    "REUSE_DIR_MARKER",
    "adopt",
    "check_reuse_dir",
    "claim",
    "cluster_state",
    "keeper_info",
    "default_reuse_dir",
    "differences",
    "ensure_reuse_dir",
    "find_reusable",
    "fingerprint",
    "keep",
    "list_kept",
    "prune_run_logs",
    "reuse_decision",
    "run_log_dir",
    "stop_kept",
]

#: Environment variables a server reads, besides its own env delta: a change in any of them starts fresh servers.
SERVER_ENV_PREFIXES = (
    "VLLM_", "CUDA_", "HIP_", "ROCR_", "HSA_", "UCX_", "NIXL_", "NCCL_", "OMP_", "MKL_", "KMP_", "HF_",
    "TRANSFORMERS_", "TORCH", "PYTORCH_", "TRITON_", "LD_", "PYTHON", "PDSERVE_SIM_",
)  # fmt: skip
SERVER_ENV_NAMES = ("PATH",)
_MAX_STATE = 1 << 20
#: State files looked at per listing (a kept cluster writes one; thousands are junk, removed as they are seen).
_MAX_STATE_FILES = 4096
_NAMED_REMOVALS = 3  # removed junk files named one by one; the rest are counted
_CONNECT_TIMEOUT = 2.0
_KEEPER_START_TIMEOUT = 15.0
_CLAIM_TIMEOUT = 20.0
_KEEPER_EXIT_TIMEOUT = 10.0  # a keeper with no cluster left exits at once (its guard: up to 5 s on SIGTERM)
_MAX_KEEPER_LOG = 1 << 20
#: Run log directories kept in ``<reuse dir>/logs`` besides those of kept clusters (like pytest's basetemps).
KEEP_RUN_LOGS = 5


@dataclass(frozen=True)
class ReuseOptions:
    """How a reuse run keeps clusters: where their state lives and how long they may stay idle."""

    directory: Path
    ttl: float


# --------------------------------------------------------------------------------------------- settings


#: pytest's own rule for "running on CI" (``_pytest.compat.running_on_ci``): ``CI`` (GitHub Actions, GitLab,
#: Buildkite) or ``BUILD_NUMBER`` (Jenkins, which sets no ``CI``), non-empty. Unlike pytest, ``CI=false`` is not CI.
CI_ENV_VARS = ("CI", "BUILD_NUMBER")


def reuse_decision(reuse: bool, mode: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether this run keeps and reuses clusters, and why, in words (for the report header).

    *reuse* asked for, mode ``local`` is refused on CI (:data:`CI_ENV_VARS`: a CI job must start from fresh
    servers, and nobody would stop what it kept); mode ``force`` keeps anyway.
    """
    if not reuse:
        return False, "off"
    ci = next(
        (f"{var}={value}" for var in CI_ENV_VARS
         if (value := environ.get(var, "").strip()).lower() not in ("", "0", "false", "no")),
        None,
    )  # fmt: skip
    if ci is None:
        return True, "on" if mode != "force" else "force"
    if mode != "force":
        return False, f"off: refused because {ci} (a CI job starts fresh servers; --pd-reuse-mode=force keeps them)"
    return True, f"force ({ci} is set)"


def default_reuse_dir() -> Path:
    """``${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve}/reuse``."""
    return cache_base() / "reuse"


#: The file that makes a directory pdserve's reuse dir. pdserve removes stale state files (``*.json``) and old
#: run logs (``logs/*``) there, so it uses only a directory that is new, empty, or already carries this file:
#: ``--pd-reuse-dir=.`` or ``$HOME`` must never cost a user's ``package.json`` or ``logs/``.
REUSE_DIR_MARKER = ".pytest-pdserve-reuse"
_MARKER_TEXT = b"pytest-pdserve --pd-reuse directory: kept clusters' state and logs (see `pdserve ls`).\n"
#: Entries that do not make a directory "someone else's": the marker itself, and check_dir's writable probe.
_OWN_ENTRIES = (REUSE_DIR_MARKER, ".pdserve-probe-")


def _marked(path: Path) -> bool:
    try:
        st = os.lstat(path / REUSE_DIR_MARKER)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def check_reuse_dir(path: Path) -> None:
    """Refuse a reuse directory that is not a directory of ours, that others may write, or that is not pdserve's
    own (neither marked with :data:`REUSE_DIR_MARKER` nor empty). Changes nothing (``pdserve ls`` uses it too).

    :raises ReuseError: naming the path and what is wrong with it.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ReuseError(f"reuse directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ReuseError(f"reuse directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise ReuseError(f"reuse directory {path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ReuseError(
            f"reuse directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): anyone could plant "
            "a kept cluster there; `chmod go-w` it or choose another with --pd-reuse-dir"
        )
    if _marked(path):
        return
    try:
        with os.scandir(path) as entries:
            foreign = [e.name for e in entries if not e.name.startswith(_OWN_ENTRIES)][:3]
    except OSError as exc:
        raise ReuseError(f"reuse directory {path}: {exc.strerror or exc}") from None
    if foreign and not _marked(path):  # looked again: a concurrent run may have just made it ours
        raise ReuseError(
            f"reuse directory {path} holds files pdserve did not put there ({', '.join(sorted(foreign))}, ...): "
            "pdserve removes stale state files and old logs in it, so it must be a directory of its own (a new or "
            f"empty one, e.g. {path / 'pdserve-reuse'})"
        )


def ensure_reuse_dir(path: Path) -> Path:
    """Create the reuse directory (0700) if missing, check it (:func:`check_reuse_dir`) and mark it as pdserve's.

    :raises ReuseError: naming the path and what is wrong with it.
    """
    try:
        ensure_dir(path, 0o700)
    except PDServeError as exc:
        raise ReuseError(f"reuse directory {path}: {exc}") from None
    check_reuse_dir(path)
    if not _marked(path):
        try:
            write_replace(path / REUSE_DIR_MARKER, _MARKER_TEXT)
        except OSError as exc:
            raise ReuseError(f"reuse directory {path}: cannot create {REUSE_DIR_MARKER}: {exc.strerror}") from None
    return path


#: In a run's log directory: the run holds a shared flock on it while it lives (`lockfiles.want`), so that
#: another run's :func:`prune_run_logs` leaves it alone however old it is (a long suite in another terminal).
_RUN_ALIVE = ".pdserve-run"
_held_run_dirs: list[int] = []  # those fds, open until this process exits (the kernel then drops the locks)


def run_log_dir(reuse_dir: Path) -> Path:
    """Create this run's log directory under ``<reuse_dir>/logs`` (a reuse run without --pd-log-dir), named
    ``<time>-<pid>``, and mark it as in use for as long as this process lives."""
    path = ensure_dir(reuse_dir / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}", 0o700)
    fd = want(path / _RUN_ALIVE)
    if fd is not None:
        _held_run_dirs.append(fd)
    return path


def prune_run_logs(reuse_dir: Path, keep: int = KEEP_RUN_LOGS, min_age: float = 600.0) -> list[Path]:
    """Remove old run log directories under ``<reuse_dir>/logs``: all but the newest ``keep``, never one a kept
    cluster still writes to, nor one younger than ``min_age`` seconds or whose run still goes (a concurrent
    run's, :data:`_RUN_ALIVE`). Returns what went."""
    import shutil

    logs = reuse_dir / "logs"
    try:
        runs = sorted((p for p in logs.iterdir() if p.is_dir() and not p.is_symlink()), key=lambda p: p.name)
    except OSError:
        return []
    used = set()
    for state_path in reuse_dir.glob(f"*{STATE_SUFFIX}"):
        with contextlib.suppress(OSError, ValueError):
            for server in _read_state(state_path).servers:
                used.add(Path(str(server["log_path"])).resolve())
    removed = []
    now = time.time()
    for run in runs[: max(0, len(runs) - keep)]:
        with contextlib.suppress(OSError):
            if now - run.stat().st_mtime < min_age or any(run.resolve() in u.parents for u in used):
                continue
            if is_wanted(str(run / _RUN_ALIVE)):  # its run still goes
                continue
            shutil.rmtree(run)
            removed.append(run)
    return removed


# ------------------------------------------------------------------------------------------ fingerprint


def _canon(value: Any) -> str:
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_identity(model: str) -> str:
    """The model name, plus size and mtime of a local checkpoint's files (a rebuilt model starts fresh servers)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return model
    parts = [model]
    with contextlib.suppress(OSError):
        for entry in sorted(path.iterdir())[:64]:
            with contextlib.suppress(OSError):
                st = entry.stat()
                parts.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def _sim_identity() -> str:
    """The simulator's source files (size, mtime): editing the simulator starts fresh simulated servers."""
    sim = Path(__file__).parent / "sim"
    parts = []
    for entry in sorted(sim.glob("*.py")):
        with contextlib.suppress(OSError):
            st = entry.stat()
            parts.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def fingerprint(
    *,
    spec: ClusterSpec,
    defaults: SessionDefaults,
    setup: EngineSetup,
    model: str,
    placement: Mapping[str, Any],
    proxy_command: Sequence[str] | None,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """``{component: digest}`` of everything that shapes a cluster's servers (see the module docstring)."""
    import pytest_pdserve

    parts: dict[str, str] = {}
    for f in dataclasses.fields(spec):
        parts[f"spec.{f.name}"] = _canon(getattr(spec, f.name))
    for f in dataclasses.fields(defaults):
        if f.name != "extra_args_source":  # where the args came from does not change the servers
            parts[f"setting.{f.name}"] = _canon(getattr(defaults, f.name))
    info = setup.info
    parts["engine"] = _canon([info.name, list(info.argv_prefix), str(info.version), info.python])
    if info.name == "sim":
        parts["engine.simulator"] = _sim_identity()
    parts["engine.platform_env"] = _canon(setup.platform_env)
    parts["engine.platform_args"] = _canon(setup.platform_args)
    parts["model"] = _model_identity(model)
    for key, value in placement.items():
        parts[f"placement.{key}"] = _canon(value)
    parts["proxy_command"] = _canon(proxy_command)
    parts["pytest-pdserve"] = pytest_pdserve.__version__
    for name, value in environ.items():
        if name.startswith(SERVER_ENV_PREFIXES) or name in SERVER_ENV_NAMES:
            parts[f"env.{name}"] = value
    return {k: _digest(v) for k, v in sorted(parts.items())}


def differences(kept: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """Component names whose digests differ (or that only one side has): why a kept cluster does not fit."""
    return sorted(k for k in {*kept, *wanted} if kept.get(k) != wanted.get(k))


# -------------------------------------------------------------------------------------------- state


@dataclass
class KeptCluster:
    """One kept cluster, as its state file describes it."""

    id: str
    path: Path
    state: dict[str, Any]
    fingerprint: dict[str, str]
    keeper_pid: int
    keeper_starttime: int
    socket_name: str
    created: float
    kept_since: float
    ttl: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def spec_name(self) -> str:
        return str(self.state.get("spec_name", "?"))

    @property
    def servers(self) -> list[dict[str, Any]]:
        return [*self.state["servers"], self.state["proxy"]]

    def keeper_alive(self) -> bool:
        """Whether the keeper that wrote this state still runs (same pid *and* start time: no pid reuse)."""
        return alive_as(self.keeper_pid, self.keeper_starttime)

    def dead_server(self) -> str | None:
        """The first server that is not the process that was kept, else None (the keeper's own rule)."""
        return gone_server(self.servers)

    def foreign_listener(self) -> str | None:
        """The first server whose URL is not served by the kept process itself, in words, else None.

        The state file can be edited (by the user, or whoever can write the reuse dir): a URL pointed at another
        listener would receive this run's API key with the first request. So before any request, each URL must be
        ``http://127.0.0.1:PORT`` and PORT a listening socket of the kept pid (`proctree.listens_on`).
        """
        for server in self.servers:
            url = urlsplit(str(server.get("url", "")))
            try:
                port = url.port
            except ValueError:
                port = None
            if url.scheme != "http" or url.hostname != "127.0.0.1" or port is None:
                return f"{server.get('name')}: its URL {server.get('url')!r} is not http://127.0.0.1:PORT"
            if not listens_on(int(server["pid"]), port):
                return (
                    f"{server.get('name')}: port {port} is not a listening socket of the kept process "
                    f"(pid {server['pid']}): the state file {self.path} was changed or the port was taken over; "
                    "nothing was sent to it"
                )
        return None

    def keeper_stopped(self) -> str | None:
        """Why its keeper cannot answer now, when it is stopped (SIGSTOP, a debugger, a frozen cgroup), else None.

        A stopped keeper accepts connections (the kernel queues them) and never answers: whoever talks to it
        would wait out the timeout and then guess why. Nothing signals it for us: the user decides.
        """
        info = read_stat(self.keeper_pid)
        if info is None or info.starttime != self.keeper_starttime or info.state not in ("T", "t"):
            return None
        return (
            f"its keeper (pid {self.keeper_pid}) is stopped (SIGSTOP or a debugger): `kill -CONT {self.keeper_pid}` "
            f"lets it go on, `kill -9 {self.keeper_pid}` has its guard stop its servers"
        )


def _finite(value: Any) -> float:
    """A time or a TTL from a state file: Python's json reads ``NaN`` and ``Infinity``, which no clock shows."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _read_state(path: Path) -> KeptCluster:
    """Parse one state file (ours, regular, bounded); :raises ValueError: what is wrong with it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError("not a regular file of ours")
        if st.st_size > _MAX_STATE:  # not read at all: a directory of huge files must not cost their size
            raise ValueError("larger than 1 MiB")
        raw = os.read(fd, _MAX_STATE + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_STATE:
        raise ValueError("larger than 1 MiB")
    try:
        state = json.loads(raw)
        keeper = state["keeper"]
        for s in [*state["servers"], state["proxy"]]:
            int(s["pid"]), int(s["pgid"]), int(s["starttime"]), str(s["token"]), str(s["url"]), str(s["name"])
        return KeptCluster(
            id=str(state["id"]), path=path, state=state,
            fingerprint={str(k): str(v) for k, v in dict(state["fingerprint"]).items()},
            keeper_pid=int(keeper["pid"]), keeper_starttime=int(keeper["starttime"]), socket_name=str(keeper["socket"]),
            created=_finite(state["created"]), kept_since=_finite(keeper["since"]), ttl=_finite(keeper["ttl"]),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a kept-cluster state ({type(exc).__name__}: {exc})") from None


def _sweep(gone: Sequence[KeptCluster], grace: float) -> None:
    """Stop what is left of kept clusters whose keeper is gone (processes found by their server tokens only, in
    one pass over ``/proc``), and remove their state."""
    tokens = [(SERVER_TOKEN_ENV, str(s["token"])) for kept in gone for s in kept.servers]
    terminate([], env=tokens, grace=grace, kill_wait=10.0)
    for kept in gone:
        for server in kept.servers:
            remove_rpc_dir(server.get("rpc_dir"))
        with contextlib.suppress(OSError):
            kept.path.unlink()


def list_kept(reuse_dir: Path, *, report: Any = None, grace: float = 3.0) -> list[KeptCluster]:
    """The kept clusters in ``reuse_dir`` whose keeper runs; a keeper that is gone has its leftovers stopped
    and its state removed, and a file that is not a kept-cluster state is removed (both are reported).

    Bounded, and junk does not hide a kept cluster: every ``*.json`` (up to :data:`_MAX_STATE_FILES`) is looked
    at, one that is too large is refused by its size without reading it, the leftovers of every gone keeper are
    swept in one pass over ``/proc``, and only the first few removals are named (then a count).
    """
    say = report or (lambda msg: None)
    found, gone, removed = [], [], []
    try:
        entries = sorted(reuse_dir.glob(f"*{STATE_SUFFIX}"))
    except OSError:
        return []
    for path in entries[:_MAX_STATE_FILES]:
        try:
            kept = _read_state(path)
        except FileNotFoundError:
            continue  # its keeper stopped it meanwhile
        except (OSError, ValueError) as exc:
            try:
                path.unlink()
                removed.append(f"removed {path}: {exc}")
            except OSError as why:
                removed.append(f"ignored {path}: {exc} (cannot remove it: {why.strerror or why})")
            continue
        if kept.keeper_alive():
            found.append(kept)
        else:
            gone.append(kept)
    if gone:
        _sweep(gone, grace)
        for kept in gone:
            say(f"pdserve: reuse: kept cluster {kept.id}'s keeper (pid {kept.keeper_pid}) is gone; stopped its servers")
    for line in removed[:_NAMED_REMOVALS]:
        say(f"pdserve: reuse: {line}")
    if len(removed) > _NAMED_REMOVALS:
        say(f"pdserve: reuse: ... and {len(removed) - _NAMED_REMOVALS} more files in {reuse_dir} that were no state")
    return found


# -------------------------------------------------------------------------------------------- keeper talk


class Claim:
    """A kept cluster claimed by this run: the open connection *is* the claim (the kernel ends it if we die)."""

    def __init__(self, kept: KeptCluster, sock: socket.socket) -> None:
        self.kept = kept
        self._sock = sock

    def release(self) -> None:
        """Hand it back to its keeper (idle from now on)."""
        with contextlib.suppress(OSError):
            self._sock.close()

    def stop(self) -> None:
        """Ask its keeper to stop it now (a server died under this run)."""
        with contextlib.suppress(OSError):
            _request(self.kept, f"stop {self.kept.id}")
        self.release()


def _connect(kept: KeptCluster) -> socket.socket:
    """Connect to the keeper, checking the other end is that keeper (its pid and our uid)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_CONNECT_TIMEOUT)
    try:
        sock.connect("\0" + kept.socket_name)
        uid, pid = peer_uid_pid(sock)
        if uid != os.geteuid() or pid != kept.keeper_pid:
            raise OSError(f"socket {kept.socket_name} is served by pid {pid} uid {uid}, not by the keeper")
    except OSError:
        sock.close()
        raise
    return sock


def _readline(sock: socket.socket) -> str:
    buf = b""
    for _ in range(64):  # bounded: at most 64 chunks of a reply line
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        if b"\n" in buf:
            break
    return buf.partition(b"\n")[0].decode(errors="replace")


def _request(kept: KeptCluster, line: str, timeout: float = 60.0) -> str:
    with contextlib.closing(_connect(kept)) as sock:
        sock.settimeout(timeout)
        sock.sendall(line.encode() + b"\n")
        return _readline(sock)


def claim(kept: KeptCluster, ttl: float | None = None) -> Claim | None:
    """Claim ``kept`` for this run; None when another run holds it, or its keeper no longer has it.

    ``ttl``: this run's ``--pd-reuse-ttl``, the idle time after which the keeper stops it once we let go.
    """
    return _claim(kept, ttl)[0]


def _claim(kept: KeptCluster, ttl: float | None = None) -> tuple[Claim | None, str]:
    """``(claim, "")``, or ``(None, why not)``: ``""`` when another run holds it, else what is wrong with it."""
    stopped = kept.keeper_stopped()
    if stopped is not None:
        return None, stopped  # it would accept the connection and never answer
    try:
        sock = _connect(kept)
    except OSError as exc:
        return None, f"its keeper (pid {kept.keeper_pid}) could not be reached ({exc})"
    try:
        sock.settimeout(_CLAIM_TIMEOUT)  # the keeper may be busy stopping another cluster (a few seconds)
        sock.sendall(f"claim {kept.id}{f' {ttl!r}' if ttl is not None else ''}\n".encode())
        reply = _readline(sock)
    except OSError as exc:
        sock.close()
        late = f"did not answer in {_CLAIM_TIMEOUT:g}s" if isinstance(exc, TimeoutError) else f"failed ({exc})"
        return None, kept.keeper_stopped() or f"its keeper (pid {kept.keeper_pid}) {late}"
    if reply != "ok":
        sock.close()
        return None, {"busy": "", "unknown": "its keeper no longer keeps it"}.get(
            reply, f"its keeper (pid {kept.keeper_pid}) answered {reply!r}"
        )
    sock.settimeout(None)
    return Claim(kept, sock), ""


def keeper_info(kept: KeptCluster) -> dict[str, Any]:
    """What the keeper says of ``kept`` now (claimed, idle seconds); empty when it does not answer."""
    if kept.keeper_stopped() is not None:
        return {}
    try:
        info = json.loads(_request(kept, "info", timeout=_CONNECT_TIMEOUT))
        return dict(info.get(kept.id, {}))
    except (OSError, ValueError, AttributeError):
        return {}


def stop_kept(kept: KeptCluster, grace: float = 3.0) -> bool:
    """Stop one kept cluster: through its keeper, or (keeper gone) by sweeping its servers. True if it was stopped.

    False when its keeper runs but did not stop it (:meth:`KeptCluster.keeper_stopped` says when it cannot).
    Only server tokens are ever swept, never the pids a state file names.
    """
    if kept.keeper_stopped() is not None:
        return False
    try:
        reply = json.loads(_request(kept, f"stop {kept.id}"))
        if reply.get("left") == 0:  # that was its last cluster: it exits now; return once it did (and its guard)
            wait_for_gate(lambda: not kept.keeper_alive(), _KEEPER_EXIT_TIMEOUT, poll=0.02)
        return kept.id in reply.get("stopped", [])
    except (OSError, ValueError, AttributeError) as exc:
        # Nobody listens on its socket: that pid is no keeper (a keeper listens before it writes any state, and
        # removes its states before it exits), so the state is stale or planted: swept like a gone keeper's.
        refused = isinstance(exc, ConnectionRefusedError)
        if kept.keeper_alive() and not refused:
            return False
        _sweep([kept], grace)
        return True


# --------------------------------------------------------------------------------------------- attach


def find_reusable(
    reuse_dir: Path, wanted: Mapping[str, str], spec_name: str, report: Any, ttl: float | None = None
) -> tuple[Claim | None, str | None]:
    """Claim a kept cluster whose fingerprint is ``wanted``: ``(claim, None)``, or ``(None, why not)`` where
    ``why`` names the nearest kept cluster and the components that differ (None when nothing was kept).
    ``ttl``: this run's ``--pd-reuse-ttl`` (see :func:`claim`)."""
    kept = list_kept(reuse_dir, report=report)
    if not kept:
        return None, None
    exact = [k for k in kept if k.fingerprint == wanted]
    busy, unreachable = [], []
    for k in sorted(exact, key=lambda k: k.created):
        dead = k.dead_server()
        if dead is not None:
            report(f"pdserve: reuse: kept cluster {k.id} not reused: {dead}; stopping it")
            stop_kept(k)
            continue
        got, why = _claim(k, ttl)
        if got is not None:
            return got, None
        if why:
            unreachable.append(f"kept cluster {k.id}: {why}")
        else:
            busy.append(k.id)
    if busy or unreachable:
        in_use = [f"kept cluster {', '.join(busy)} is in use by another run"] if busy else []
        return None, "; ".join([*in_use, *unreachable])
    nearest = min(kept, key=lambda k: (k.spec_name != spec_name, len(differences(k.fingerprint, wanted))))
    diff = differences(nearest.fingerprint, wanted)
    shown = ", ".join(diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
    return None, f"kept cluster {nearest.id} differs in {shown}"


# ---------------------------------------------------------------------------------------------- keep


def _server_state(proc: Any, handle: Any, observed: ObservedConfig | None = None) -> dict[str, Any]:
    info = read_stat(proc.pid)
    command = handle.command
    return {
        "name": proc.name, "role": handle.role, "index": handle.index, "url": handle.url, "pid": proc.pid,
        "pgid": proc.pgid, "starttime": info.starttime if info is not None else -1, "token": proc.server_token,
        "log_path": str(proc.log_path), "gpus": list(handle.gpus),
        "rpc_dir": str(proc.rpc_dir) if proc.rpc_dir is not None else None,
        "ports": list(dataclasses.astuple(handle.ports)) if handle.ports is not None else None,
        "argv": redact_argv(command.argv) if command is not None else None,  # an --hf-token's value is a secret
        # The API key stays out of the file (the next run has it in its own settings: the fingerprint matched), and
        # so does any other secret a spec's env carries (HF_TOKEN, ...): shown as *** in the adopted command.
        "env": redact_env({k: v for k, v in command.env.items() if k != "VLLM_API_KEY"}) if command else None,
        "ready_seconds": handle.ready_seconds,
        # What /v1/models listed at the start: an attach that finds more (a LoRA adapter a test loaded) or less
        # refuses the cluster (see adopt, _changed_since_start).
        "served_models": list(observed.served_models) if observed is not None else None,
        # ``/weight_info`` at the start: an RL-style test that set another weight version changed the weights.
        "weight_version": observed.weight_version if observed is not None else None,
    }  # fmt: skip


def cluster_state(
    launched: LaunchedCluster,
    fingerprint_: Mapping[str, str],
    run_token: str,
    release_gate: Sequence[str] | None = None,
) -> dict[str, Any]:
    """What the keeper writes for one cluster (no secret: digests, URLs, pids, tokens, logs).

    ``release_gate``: the GPU UUIDs whose leases the keeper hands back only once nvidia-smi lists none of the
    servers on them (`gpu_plan.GpuPlanner.gated_keys`; None off real CUDA).
    """
    cluster = launched.cluster
    by_name = {p.name: p for p in launched.processes}
    at_start = cluster.observed or {}
    servers = [_server_state(by_name[h.name], h, at_start.get(h.name)) for h in (*cluster.prefill, *cluster.decode)]
    return {
        "id": f"{launched.label}-{os.urandom(3).hex()}", "spec_name": cluster.spec.name, "label": launched.label,
        "created": time.time() - cluster.started_seconds, "fingerprint": dict(fingerprint_), "run_token": run_token,
        "engine": cluster.engine, "model": cluster.model, "vllm_version": cluster.vllm_version,
        "block_size": cluster.block_size, "attention_backend": cluster.attention_backend_asked,
        "platform": cluster.platform, "started_seconds": cluster.started_seconds,
        "pd_ready_seconds": cluster.pd_ready_seconds, "topology": [len(cluster.prefill), len(cluster.decode)],
        "servers": servers, "proxy": _server_state(by_name["proxy"], cluster.proxy),
        "release_gate": list(release_gate) if release_gate else None,
    }  # fmt: skip


def keep(
    items: Iterable[tuple[dict[str, Any], Sequence[tuple[int, str]], Sequence[str]]],
    *,
    reuse_dir: Path,
    ttl: float,
    grace: float,
    run_token: str,
) -> int:
    """Start one keeper for ``(state, [(lease fd, lock file)], want files)`` items; returns its pid once it owns them.

    :raises ReuseError: it did not say it was ready (its log is ``<reuse_dir>/keeper.log``).
    """
    items = list(items)
    order = {
        "reuse_dir": str(reuse_dir), "ttl": ttl, "grace": grace, "run_token": run_token,
        "clusters": [{"state": s, "locks": [list(x) for x in locks], "want": list(want)} for s, locks, want in items],
    }  # fmt: skip
    fds = sorted({fd for _, locks, _ in items for fd, _ in locks})
    env = {k: v for k, v in os.environ.items() if k not in (RUN_TOKEN_ENV, SERVER_TOKEN_ENV)}  # no sweep hits it
    log_path = reuse_dir / "keeper.log"
    with contextlib.suppress(OSError):
        if log_path.stat().st_size > _MAX_KEEPER_LOG:  # every keeper appends to it: keep one old copy, not all
            os.replace(log_path, reuse_dir / "keeper.log.1")
    try:
        log = open_append(log_path)
    except OSError as exc:
        raise ReuseError(f"the reuse keeper did not start: its log {log_path}: {exc.strerror or exc}") from None
    try:
        proc = subprocess.Popen(
            isolated_argv("pytest_pdserve.keeper"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            env=env, pass_fds=fds, start_new_session=True, close_fds=True,
        )  # fmt: skip
    finally:
        os.close(log)
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(order).encode())
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
    if not line.startswith("ready "):
        raise ReuseError(f"the reuse keeper did not start: it said {line!r}; see {log_path}")
    return int(line.split()[1])


def _read_line_within(stream: Any, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf and time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
    return buf.partition(b"\n")[0].decode(errors="replace")


# --------------------------------------------------------------------------------------------- adopt


def _not_scheduling(h: Any) -> str | None:
    """Why a server schedules no request, in words, or None. vLLM 0.32's ``/is_sleeping`` is true while the
    scheduler is paused (``/pause``, ``/sleep`` at any level: ``EngineCore.is_sleeping``); ``/is_paused`` says so
    on its own where ``/is_sleeping`` counts only the executor. A server without either route: nothing says so."""
    from pytest_pdserve.deadline import get_within

    for route, key in (("/is_sleeping", "is_sleeping"), ("/is_paused", "is_paused")):
        try:
            r = get_within(h.client, route, 5.0)
            if r.status_code == 200 and bool(r.json().get(key)):
                return f"{h.name} is asleep or paused (POST /sleep or /pause without /wake_up or /resume)"
        except Exception:  # an older server, a body that is not JSON: nothing says it stopped
            continue
    return None


#: vLLM's route for loading a LoRA adapter while serving (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).
LORA_LOAD_ROUTE = "POST /v1/load_lora_adapter"


def _changed_since_start(server: Mapping[str, Any], now: ObservedConfig | None) -> list[str]:
    """What ``server`` serves now that it did not at its start, in words (empty: nothing changed).

    Two things a test can change over HTTP that the prefix-cache reset does not undo: the models served (vLLM
    lists runtime-loaded LoRA adapters in ``/v1/models``, ``OpenAIServingModels.show_available_models``, and
    serves them by name) and the weights (``/weight_info``'s version, which an RL trainer's
    ``/update_weight_version`` or ``/finish_weight_update`` sets). A state kept by a version that did not record
    one, or a value not read back, is not compared.
    """
    if now is None:
        return []
    found = []
    if server.get("served_models") is not None and list(server["served_models"]) != list(now.served_models):
        before, after = list(server["served_models"]), list(now.served_models)
        parts = []
        if added := [m for m in after if m not in before]:
            parts.append(f"now also serves {', '.join(added)} (a LoRA adapter loaded at run time: {LORA_LOAD_ROUTE})")
        if removed := [m for m in before if m not in after]:
            parts.append(f"no longer serves {', '.join(removed)}")
        found.append(f"{server['name']} {'; '.join(parts) or f'lists {after} instead of {before}'}")
    was = server.get("weight_version")
    if was is not None and now.weight_version is not None and now.weight_version != was:
        found.append(
            f"{server['name']} runs weight version {now.weight_version!r}, not {was!r} as at its start (weights "
            "changed at run time: POST /update_weight_version or /finish_weight_update)"
        )
    return found


#: NixlConnector's ``kv_lease_duration`` when the config sets none (vLLM 0.32's ``nixl/base_scheduler.py``).
DEFAULT_KV_LEASE = 30.0
_HELD_MARGIN = 5.0  # past the lease: the server frees expired leases on its own ticks


def _kv_lease_seconds(argv: Sequence[str] | None) -> float:
    """The longest ``kv_lease_duration`` in a server's ``--kv-transfer-config`` (at the top, or in a
    MultiConnector's ``connectors``); :data:`DEFAULT_KV_LEASE` where none is set or the argv is unknown."""
    try:
        assert argv is not None
        config = json.loads(argv[list(argv).index("--kv-transfer-config") + 1])
    except (AssertionError, ValueError, IndexError):
        return DEFAULT_KV_LEASE
    leases: list[float] = []
    todo = [config]
    for _ in range(64):  # bounded: a config nests a few connectors at most
        if not todo:
            break
        node = todo.pop()
        extra = node.get("kv_connector_extra_config") if isinstance(node, Mapping) else None
        if isinstance(extra, Mapping):
            lease = extra.get("kv_lease_duration")
            if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0:
                leases.append(float(lease))
            todo.extend(c for c in extra.get("connectors") or () if isinstance(c, Mapping))
    return max(leases, default=DEFAULT_KV_LEASE)


def _reset_prefix_cache(h: Any, argv: Sequence[str] | None, report: Callable[[str], None]) -> None:
    """Reset one kept server's prefix cache (with the connector's: `clients.reset_prefix_cache`), waiting while
    KV blocks are held: a run's last prefill whose KV no decode read keeps its blocks until NixlConnector's lease
    ends, and a reset fails until then. Bounded by that lease; :raises ReuseError: no reset."""
    from pytest_pdserve.errors import PrefixCacheHeld

    wait = _kv_lease_seconds(argv) + _HELD_MARGIN
    deadline = time.monotonic() + wait
    for attempt in range(100_000):  # bounded by the deadline; the count only against a logic error
        try:
            reset = h.reset_prefix_cache()
        except PrefixCacheHeld as exc:
            if time.monotonic() >= deadline:
                raise ReuseError(f"resetting {h.name}'s prefix cache failed for {wait:g}s: {exc}") from None
            if attempt == 0:
                report(
                    f"pdserve: reuse: {h.name} still holds KV blocks (a request left them; NixlConnector's lease "
                    f"frees them): waiting up to {wait:g}s to reset its prefix cache"
                )
            time.sleep(0.2)  # the server frees them on its own clock: poll it, bounded above
            continue
        except AssertionError as exc:
            raise ReuseError(f"resetting {h.name}'s prefix cache failed: {exc}") from None
        if not reset:
            raise ReuseError(f"{h.name} has no POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1 was turned off)")
        return


def adopt(
    claim: Claim,
    spec: ClusterSpec,
    *,
    api_key: str | None,
    max_model_len: int | None,
    report: Callable[[str], None] = lambda msg: None,
) -> LaunchedCluster:
    """The claimed kept cluster as this run's `LaunchedCluster`, after proving it is the one that was kept.

    Every server must be the kept process (pid and start time), answer ``/health`` and schedule requests (not
    asleep, not paused: `_not_scheduling`); what the servers run is read back as at a fresh start
    (`verify.verify_cluster`), and the models served and the weight version must be what they were at the start
    (`_changed_since_start`); then the prefill and decode prefix caches are reset (a previous run's prompts must not
    warm this run's; `_reset_prefix_cache` waits for KV blocks a prefill-only request left held).
    :raises ReuseError: what failed; every change a test left is named (the caller stops the cluster).
    """
    import httpx

    from pytest_pdserve import verify
    from pytest_pdserve.clients import http_transport
    from pytest_pdserve.cluster import PDCluster, Reused, ServerHandle
    from pytest_pdserve.commands import ServerCommand, ServerPorts
    from pytest_pdserve.deadline import get_within
    from pytest_pdserve.launch import LaunchedCluster

    t0 = time.monotonic()
    kept = claim.kept
    state = kept.state
    dead = kept.dead_server()
    if dead is not None:
        raise ReuseError(dead)
    foreign = kept.foreign_listener()  # before the first request: each carries the API key
    if foreign is not None:
        raise ReuseError(foreign)

    def handle(s: Mapping[str, Any]) -> ServerHandle:
        command = None
        if s.get("argv") is not None:
            env: dict[str, str | None] = dict(s.get("env") or {})
            env["VLLM_API_KEY"] = api_key  # kept out of the state file; the fingerprint says it is the same key
            command = ServerCommand(s["role"], int(s["index"]), tuple(s["argv"]), env)
        ports = ServerPorts(*(int(p) for p in s["ports"])) if s.get("ports") else None
        return ServerHandle(
            s["role"], int(s["index"]), str(s["url"]), api_key, Path(s["log_path"]), None, command, ports,
            tuple(s.get("gpus") or ()), s.get("ready_seconds"),
        )  # fmt: skip

    servers = [handle(s) for s in state["servers"]]
    proxy = handle(state["proxy"])
    if proxy.ports is None:
        proxy.ports = ServerPorts(proxy.port, 0, 0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=2.0, trust_env=False, transport=http_transport()) as client:
        for h in (*servers, proxy):
            try:
                status = get_within(client, f"{h.url}/health", 2.0).status_code
            except httpx.HTTPError as exc:
                raise ReuseError(f"{h.name} at {h.url} does not answer /health: {type(exc).__name__}") from None
            if status != 200:
                raise ReuseError(f"{h.name} at {h.url} answers /health with HTTP {status}")
    cluster = PDCluster(
        spec=spec, engine=str(state["engine"]), model=str(state["model"]), block_size=int(state["block_size"]),
        attention_backend_asked=state.get("attention_backend"),
        prefill=tuple(h for h in servers if h.role == "prefill"),
        decode=tuple(h for h in servers if h.role == "decode"), proxy=proxy,
        platform=str(state.get("platform", "cpu")), vllm_version=state.get("vllm_version"),
        reused=Reused(kept.id, time.time() - kept.created, float(state.get("started_seconds") or 0.0)),
    )  # fmt: skip
    # Everything a test left changed is named at once (a person fixes all of it in one go), then refused; the
    # resets come last, as they may wait for held KV blocks.
    problems = [p for h in (*cluster.prefill, *cluster.decode) if (p := _not_scheduling(h)) is not None]
    observed = verify.verify_cluster(cluster, max_model_len=max_model_len)
    for s in state["servers"]:
        problems += _changed_since_start(s, observed.get(str(s["name"])))
    if problems:
        raise ReuseError("; ".join(problems))
    argv_of = {str(s["name"]): s.get("argv") for s in state["servers"]}
    for h in (*cluster.prefill, *cluster.decode):
        _reset_prefix_cache(h, argv_of.get(h.name), report)
    cluster.started_seconds = time.monotonic() - t0
    return LaunchedCluster(cluster, [], None, [], str(state["label"]), fingerprint=kept.fingerprint, claim=claim)
