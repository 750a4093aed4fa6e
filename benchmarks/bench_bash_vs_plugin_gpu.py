"""vLLM's own P/D scripts against the plugin, on one real GPU: wall time to each module's verdict, and GPU-seconds.

For one of ``edge``, ``mamba``, ``multi``: first vLLM's own script (``run_edge_case_test.sh``,
``run_mamba_prefix_cache_test.sh``, ``run_multi_connector_edge_case_test.sh``, as fetched from vLLM's sdist by
scripts/fetch-vllm-tests.sh), then the plugin's command for the same module (``pytest <module> --pd-engine=vllm
--pd-export-env --pd-preset=<preset> --pd-share-gpus``), on the same GPU, model, attention backend and memory:

- both servers on GPU 0 (the scripts hard-code GPUs 4/5 or 0/1; those lines are set to 0, the only edits made to
  a script, printed before it runs), the tiny models instead of the scripts' Hub models (the device has no
  network: ``MODEL``/``MODEL_NAMES`` where the script reads them, its ``MODELS`` line where it does not);
- memory as the plugin's preset sets it: edge 0.2 per server (the script's own), mamba 0.4 (the script's 0.8
  twice does not fit one GPU; ``GPU_MEMORY_UTILIZATION``, which the script honours), multi the preset's KV bytes
  for the tiny model (``KV_CACHE_MEMORY_BYTES``, which the script honours);
- the attention backend each side defaults to (the mamba script's FLASHINFER, vLLM's choice for the others);
- the scripts' ``pkill -f "vllm serve"`` kept to the script's own session (a ``pkill`` shim first on PATH), so a
  run never stops a server it did not start.

Measured from the command's start: ``verdict`` (the module's pytest summary line appears), ``exit`` (the command
is done, servers stopped), and ``GPU-s`` (seconds in which nvidia-smi listed any compute process; one GPU, so
GPU-seconds held). Runs on the device, in the vLLM venv (scripts/gpu-proof.sh --engine=vllm, suites ``vs-edge``,
``vs-mamba``, ``vs-multi``); prints a table and appends one JSON line per side to ``--record``.

    <vllm-venv>/bin/python benchmarks/bench_bash_vs_plugin_gpu.py edge --vllm <vllm-venv>/bin/vllm \\
        --modules .cache/vllm-tests/0.26.0/nixl_integration [--work DIR] [--logs DIR] [--record FILE] [--budget S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
#: module -> (script, test module, preset, tiny model kind)
MODULES = {
    "edge": ("run_edge_case_test.sh", "test_edge_cases.py", "vllm-edge-case", "llama"),
    "mamba": ("run_mamba_prefix_cache_test.sh", "test_mamba_prefix_cache.py", "vllm-mamba-prefix-cache", "nemotronh"),
    "multi": ("run_multi_connector_edge_case_test.sh", "test_multi_connector_edge_cases.py",
              "vllm-multi-connector-edge-case", "llama"),
}  # fmt: skip
#: The scripts' hard-coded GPU ids (``PREFILL_GPU_ID=4``, ``local DECODE_GPU=1``): both set to 0.
GPU_LINE = re.compile(r"^(\s*(?:local\s+)?(?:PREFILL|DECODE)_GPU(?:_ID)?=)(\d+)", re.M)
#: The scripts' Hub model, where no variable replaces it (run_edge_case_test.sh's MODELS array).
HUB_MODEL = "Qwen/Qwen3-0.6B"
VERDICT = re.compile(r"^=+ (.*\b(passed|failed|errors?|no tests ran)\b.*) in ([\d.]+)s")
PKILL_SHIM = """#!/bin/sh
# bench_bash_vs_plugin_gpu.py: the script's pkill, kept to the script's own session.
exec /usr/bin/pkill -s "$(ps -o sid= -p $$ | tr -d ' ')" "$@"
"""
CURL_SHIM = """#!{python}
# bench_bash_vs_plugin_gpu.py: `curl -s URL` for the scripts' wait loops, where the machine has no curl.
import sys, urllib.error, urllib.request
url = [a for a in sys.argv[1:] if not a.startswith("-")][-1]
try:
    urllib.request.urlopen(url if "://" in url else "http://" + url, timeout=5)
except urllib.error.HTTPError:
    pass
except OSError:
    sys.exit(7)
"""
#: The scripts' first line after both wait_for_server loops: the proxy's start (an echo, or `set -x`'s trace).
PROXY_START = re.compile(r"Starting proxy server|\+ python3? .*toy_proxy")
READY = re.compile(r"pdserve: cluster \S+ .*ready in ([\d.]+)s")


@dataclass
class Side:
    module: str
    way: str
    command: str
    exit: int | None = None
    verdict: str = ""
    verdict_s: float | None = None
    exit_s: float = 0.0
    gpu_s: float = 0.0
    ready_s: float | None = None
    cut: bool = False
    note: str = ""
    edits: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


class GpuSampler(threading.Thread):
    """Adds up the seconds in which nvidia-smi lists any compute process (0.5 s samples)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.busy_s = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self._halt.is_set():
            busy = bool(compute_pids())
            now = time.monotonic()
            if busy:
                self.busy_s += now - last
            last = now
            self._halt.wait(0.5)

    def stop(self) -> float:
        self._halt.set()
        self.join(10)
        return self.busy_s


def compute_pids() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=False).stdout  # fmt: skip
    return [int(x) for x in out.split() if x.strip().isdigit()]


def wait_gpu_free(timeout: float = 90.0) -> list[int]:
    """Wait (bounded) until no compute process is on the GPU; SIGKILL what is left after that (this machine's
    processes are all this run's). Returns the pids that had to be killed."""
    deadline = time.monotonic() + timeout
    while (pids := compute_pids()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return pids


def pump(stream: IO[str], log: IO[str], t0: float, side: Side) -> None:
    for line in stream:
        now = time.monotonic() - t0
        log.write(f"[{now:8.2f}] {line}")
        log.flush()
        text = line.strip()
        if side.verdict_s is None and (m := VERDICT.match(text)):
            side.verdict_s, side.verdict = round(now, 2), m.group(1).strip("= ")
        if side.ready_s is None and (m := READY.search(text)):
            side.ready_s = float(m.group(1))
        if side.way == "bash" and side.ready_s is None and PROXY_START.search(text):
            side.ready_s = round(now, 2)  # both wait_for_server loops are done: the servers answer


def run_side(side: Side, argv: list[str], cwd: Path, env: dict[str, str], log_path: Path, budget: float) -> Side:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sampler = GpuSampler()
    sampler.start()
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {side.command}\n# cwd {cwd}\n# env {json.dumps(side.env)}\n")
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        reader = threading.Thread(target=pump, args=(proc.stdout, log, t0, side), daemon=True)
        reader.start()
        deadline = t0 + max(budget, 1.0)
        seen_servers = False
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            servers = session_servers(proc.pid)
            seen_servers = seen_servers or servers > 0
            if side.way == "bash" and seen_servers and servers == 0 and side.verdict_s is None:
                # The script's servers are gone before its module ran: the script itself would now wait in
                # wait_for_server until its own timeout (600 or 1200 s). Record that and stop it here.
                side.note = f"its servers exited at {time.monotonic() - t0:.0f} s; the script waits in wait_for_server"
                break
        side.exit = proc.poll()
        if side.exit is None:
            side.cut = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        side.exit_s = round(time.monotonic() - t0, 2)
        reader.join(30)
        killed = wait_gpu_free()
        if killed:
            log.write(f"# left on the GPU after the command, SIGKILLed: {killed}\n")
    side.gpu_s = round(sampler.stop(), 1)
    return side


def session_servers(sid: int) -> int:
    """How many `vllm serve` processes run in session ``sid`` (the command's, started with a session of its own)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != sid:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        count += b"vllm serve" in cmdline or b"bin/vllm serve" in cmdline
    return count


def tiny_model(kind: str, python: str) -> str:
    from pytest_pdserve.engines.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(kind, python))


def multi_kv_bytes() -> str:
    """The plugin preset's ``--kv-cache-memory-bytes`` for the tiny model (its eviction test needs the script's
    token capacity, not its bytes)."""
    from pytest_pdserve.config import presets
    from pytest_pdserve.spec import ClusterSpec

    spec = presets.resolve("vllm-multi-connector-edge-case", spec_type=ClusterSpec, environ={}, engine="vllm",
                           platform="cuda").spec  # fmt: skip
    args = list(spec.extra_args)
    return args[args.index("--kv-cache-memory-bytes") + 1]


def prepare_script(modules: Path, work: Path, script: str, model: str | None) -> tuple[Path, list[str]]:
    """A copy of the modules under ``<work>/tests/v1/kv_connector/nixl_integration`` (the scripts find their
    modules from GIT_ROOT, four levels up), the script's GPU lines set to 0; returns it and the edits made."""
    dest = work / "tests" / "v1" / "kv_connector" / "nixl_integration"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(modules, dest)
    path = dest / script
    text = path.read_text(encoding="utf-8")
    edits = [f"{m.group(0).strip()} -> {m.group(1).strip()}0" for m in GPU_LINE.finditer(text) if m.group(2) != "0"]
    text = GPU_LINE.sub(lambda m: m.group(1) + "0", text)
    if model is not None:
        count = text.count(f'"{HUB_MODEL}"')
        if count != 1:
            raise SystemExit(f"{script}: expected the Hub model {HUB_MODEL!r} once in its MODELS list, found {count}")
        text = text.replace(f'"{HUB_MODEL}"', f'"{model}"')
        edits.append(f'MODELS "{HUB_MODEL}" -> "{model}"')
    path.write_text(text, encoding="utf-8")
    return dest, edits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", choices=sorted(MODULES))
    parser.add_argument("--vllm", required=True, help="the vLLM venv's vllm executable")
    parser.add_argument("--modules", required=True, type=Path, help="vLLM's nixl_integration directory")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-bash-vs-plugin"))
    parser.add_argument("--logs", type=Path, default=None, help="where each side's timestamped output goes")
    parser.add_argument("--record", type=Path, default=None, help="append one JSON line per side here")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for both sides together")
    args = parser.parse_args(argv)
    t_all = time.monotonic()
    script, test_module, preset, kind = MODULES[args.module]
    venv_bin = str(Path(args.vllm).resolve().parent)
    python = str(Path(venv_bin) / "python")
    logs = args.logs or args.work / "logs"
    model = tiny_model(kind, python)
    # The scripts' cleanup is `pkill -f "vllm serve"`, which would stop every vLLM server on the machine: a pkill
    # first on PATH keeps it to the script's own session (pkill -s), so the bench stops nothing it did not start.
    shims = args.work / "bin"
    shims.mkdir(parents=True, exist_ok=True)
    (shims / "pkill").write_text(PKILL_SHIM, encoding="utf-8")
    (shims / "pkill").chmod(0o755)
    shim_notes = []
    if shutil.which("curl") is None:
        # The scripts wait with `until curl -s localhost:PORT/v1/completions; do sleep 1; done`: without curl that
        # loop never ends. The stand-in answers as `curl -s` does: 0 on any HTTP answer, 7 when nothing listens.
        (shims / "curl").write_text(CURL_SHIM.format(python=sys.executable), encoding="utf-8")
        (shims / "curl").chmod(0o755)
        shim_notes.append("curl: a stand-in (this machine has none)")
    base_env = dict(os.environ, PATH=f"{shims}:{venv_bin}:{os.environ.get('PATH', '')}")
    for var in ("MODEL", "MODEL_NAMES", "GPU_MEMORY_UTILIZATION", "KV_CACHE_MEMORY_BYTES", "ATTENTION_BACKEND",
                "PREFILL_GPU_ID", "DECODE_GPU_ID", "CUDA_VISIBLE_DEVICES"):  # fmt: skip
        base_env.pop(var, None)

    # The bash way: vLLM's script, its GPU ids set to 0, the tiny model, memory that fits one GPU.
    # The plugin stays out of the script's own pytest run (a user of the scripts would not have it installed).
    bash_env = {"PREFILL_GPU_ID": "0", "DECODE_GPU_ID": "0", "PYTEST_ADDOPTS": "-p no:pdserve"}
    if args.module == "mamba":
        # The script's --max-model-len 16384 on the tiny model, which declares 2048 positions: vLLM refuses it unless
        # told, and the plugin's preset tells it (presets.resolve), so the script's servers get the same variable.
        bash_env |= {"MODEL": model, "GPU_MEMORY_UTILIZATION": "0.4", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    elif args.module == "multi":
        bash_env |= {"MODEL_NAMES": model, "KV_CACHE_MEMORY_BYTES": multi_kv_bytes()}
    root = args.work / f"vllm-{args.module}"
    dest, edits = prepare_script(args.modules, root, script, model if args.module == "edge" else None)
    bash = Side(args.module, "bash", f"bash {script}", edits=edits + shim_notes, env=bash_env)
    print(f"{script}: edits {edits}; env {bash_env}", flush=True)
    wait_gpu_free()
    budget = args.budget - (time.monotonic() - t_all)
    run_side(bash, ["bash", str(dest / script)], dest, base_env | bash_env, logs / f"bash-{args.module}.log",
             budget / 2)  # fmt: skip

    # The plugin way: the command docs/migrating.md gives, on the same GPU, with the preset's memory.
    plugin_env = {"GPU_MEMORY_UTILIZATION": "0.4"} if args.module == "mamba" else {}
    cmd = [python, "-m", "pytest", test_module, "--pd-engine=vllm", "--pd-export-env", f"--pd-preset={preset}",
           "--pd-share-gpus", "--pd-startup-timeout=420", "-p", "no:cacheprovider", "-v", "-rA",
           f"--pd-log-dir={logs / ('plugin-' + args.module)}"]  # fmt: skip
    plugin = Side(args.module, "plugin", " ".join(["pytest", *cmd[3:]]), env=plugin_env)
    budget = args.budget - (time.monotonic() - t_all)
    run_side(plugin, cmd, dest, base_env | plugin_env, logs / f"plugin-{args.module}.log", budget)

    rows = []
    for side in (bash, plugin):
        verdict = side.verdict or side.note or ("cut at budget" if side.cut else f"exit {side.exit}")
        rows.append([args.module, side.way, verdict,
                     f"{side.ready_s:.1f}" if side.ready_s is not None else "-",
                     f"{side.verdict_s:.1f}" if side.verdict_s is not None else "-", f"{side.exit_s:.1f}",
                     f"{side.gpu_s:.1f}"])  # fmt: skip
        if args.record:
            with open(args.record, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(asdict(side)) + "\n")
    head = ["module", "way", "verdict", "servers ready (s)", "to verdict (s)", "to exit (s)", "GPU-s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if bash.verdict_s and plugin.verdict_s:
        print(f"bash / plugin to verdict: {bash.verdict_s / plugin.verdict_s:.2f}x; "
              f"GPU-s {bash.gpu_s / max(plugin.gpu_s, 0.1):.2f}x", flush=True)  # fmt: skip
    return 0 if bash.exit == 0 and plugin.exit == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
