#!/usr/bin/env python3
"""Prove real vLLM (CPU) P/D over NixlConnector works with the argv shape pytest-pdserve uses; capture facts.

Usage (from the repo root, with the dev venv that has httpx):

    .venv/bin/python scripts/smoke-real-pd.py [--venv .venv-vllm] [--out tests/data/vllm-cpu]
                                              [--keep-prog-thread] [--probes]

Starts a prefill (kv_producer) and a decode (kv_consumer) `vllm serve` of the tiny Llama, each in its own
session, sends P/D requests the way a proxy does, and writes what it saw to --out: /version, /v1/models,
/metrics of both servers after a P/D request, the prefill's kv_transfer_params, an SSE stream, and a
summary.json with timings and idle CPU. --keep-prog-thread sets VLLM_NIXL_KEEP_PROG_THREAD=1 (plugin off)
and writes summary-keep-prog-thread.json instead, for the idle-CPU comparison. --probes then checks what
a taken port and several --attention-backend values do. Every server is stopped with SIGTERM to its
process group and the script fails if any process of ours is left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytest_pdserve.engines import cpu, tiny_model, vllm_compat  # noqa: E402

HOST = "127.0.0.1"
TOKEN_VAR = "PDSERVE_RUN_TOKEN"
PROMPT = (
    "Kalomi neru tadevi so pa zuhori geboan elis onur the a of to and in is it you that he was for on are "
    "with as I his they be at one have this from. Rutaso vide pazu hori gebo anel ison urka lomi nerut."
) * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def tree_pids(root: int) -> list[int]:
    """root and all descendants, from /proc (children lists)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)
        except (OSError, IndexError):
            pass
    return total


def idle_cpu_percent(root: int, seconds: float = 5.0) -> float:
    pids = tree_pids(root)
    hz = os.sysconf("SC_CLK_TCK")
    t0, c0 = time.monotonic(), cpu_ticks(pids)
    time.sleep(seconds)  # measuring an interval: nothing to await
    t1, c1 = time.monotonic(), cpu_ticks(pids)
    return round(100.0 * (c1 - c0) / hz / (t1 - t0), 1)


def our_pids(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"{TOKEN_VAR}={token}".encode() in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found


def wait_all_gone(token: str, timeout: float = 15.0) -> tuple[list[int], float]:
    """Poll until no process carries our run token (children exit a little after the group leader)."""
    t0 = time.monotonic()
    left = our_pids(token)
    while left and time.monotonic() - t0 < timeout:
        time.sleep(0.2)
        left = our_pids(token)
    return left, round(time.monotonic() - t0, 2)


class Server:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.t0 = time.monotonic()
        self.health_log: list[tuple[float, str]] = []
        with log.open("wb") as f:
            self.proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 30.0) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            if self.wait_exit(grace) is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return round(time.monotonic() - t0, 2)


def wait_healthy(server: Server, url: str, timeout: float = 300.0) -> float:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited {server.proc.returncode}; see {server.log}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            state = f"{r.status_code} {r.text!r}"
        except httpx.HTTPError as exc:
            state = type(exc).__name__
        if state != last:
            server.health_log.append((round(time.monotonic() - server.t0, 1), state))
            last = state
        if state.startswith("200"):
            return round(time.monotonic() - server.t0, 1)
        time.sleep(0.25)
    raise RuntimeError(f"{server.name} not healthy after {timeout} s; see {server.log}")


def start_pair(args: argparse.Namespace, model: Path, work: Path, token: str) -> tuple[Server, Server, dict[str, Any]]:
    vllm = str(Path(args.venv) / "bin" / "vllm")
    version = vllm_compat.installed_vllm_version(vllm)
    producer, consumer = vllm_compat.kv_roles(version)
    servers, info = [], {"vllm_version": str(version)}
    for role, kv_role in (("prefill", producer), ("decode", consumer)):
        port, side, window = free_port(), free_port(), free_port()
        kvc = json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"},
                         separators=(",", ":"))  # fmt: skip
        argv = [vllm, "serve", str(model), "--host", HOST, "--port", str(port), "--kv-transfer-config", kvc,
                "--block-size", "128", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
                "--enable-prefix-caching", *cpu.cpu_server_args()]  # fmt: skip
        env = dict(os.environ)
        env.update(cpu.cpu_server_env(work))
        env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
                    "VLLM_PORT": str(window), "VLLM_HOST_IP": HOST, TOKEN_VAR: token})  # fmt: skip
        if role == "prefill":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # decode runs without it: compare /reset_prefix_cache
        if args.keep_prog_thread:
            env["VLLM_NIXL_KEEP_PROG_THREAD"] = "1"
        info[role] = {"argv": argv, "http_port": port, "side_channel_port": side, "vllm_port": window,
                      "url": f"http://{HOST}:{port}"}  # fmt: skip
        servers.append(Server(role, argv, env, work / f"{role}.log"))
    t0 = time.monotonic()
    for s in servers:
        info[s.name]["startup_s"] = wait_healthy(s, info[s.name]["url"])
        info[s.name]["health_transitions"] = s.health_log
    info["pair_startup_s"] = round(time.monotonic() - t0, 1)
    return servers[0], servers[1], info


def pd_request(
    client: httpx.Client, p_url: str, d_url: str, body: dict[str, Any]
) -> tuple[dict[str, Any], Any, float, float]:
    pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})  # fmt: skip
    t0 = time.monotonic()
    r1 = client.post(p_url + "/v1/completions", json=pre)
    r1.raise_for_status()
    t1 = time.monotonic()
    kvp = r1.json()["kv_transfer_params"]
    dec = dict(body, kv_transfer_params=kvp)
    if body.get("stream"):
        with client.stream("POST", d_url + "/v1/completions", json=dec) as r2:
            r2.raise_for_status()
            raw = "".join(r2.iter_text())
        return kvp, raw, t1 - t0, time.monotonic() - t1
    r2 = client.post(d_url + "/v1/completions", json=dec)
    r2.raise_for_status()
    return kvp, r2.json(), t1 - t0, time.monotonic() - t1


def run_pair(args: argparse.Namespace, model: Path, work: Path, out: Path) -> dict[str, Any]:
    token = uuid.uuid4().hex
    p, d, info = start_pair(args, model, work, token)
    try:
        p_url, d_url = info["prefill"]["url"], info["decode"]["url"]
        info["idle_cpu_percent_after_start"] = {"prefill": idle_cpu_percent(p.proc.pid),
                                                "decode": idle_cpu_percent(d.proc.pid)}  # fmt: skip
        with httpx.Client(timeout=60) as c:
            model_id = str(model)
            body = {"model": model_id, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "seed": 0}
            kvp, res, tp, td = pd_request(c, p_url, d_url, body)
            kvp2, res2, tp2, td2 = pd_request(c, p_url, d_url, body)
            info["kv_transfer_params_first"], info["kv_transfer_params_repeat"] = kvp, kvp2
            info["pd_text"], info["pd_deterministic"] = res["choices"][0]["text"], res == res2 or (
                res["choices"][0]["text"] == res2["choices"][0]["text"])
            info["pd_latency_s"] = {"prefill": round(tp, 3), "decode": round(td, 3),
                                    "prefill_repeat": round(tp2, 3), "decode_repeat": round(td2, 3)}  # fmt: skip
            info["pd_response_decode"] = res
            single = c.post(p_url + "/v1/completions", json=body).json()
            info["pd_equals_single_prefill_server"] = single["choices"][0]["text"] == info["pd_text"]
            if not args.keep_prog_thread:
                for name, url in (("prefill", p_url), ("decode", d_url)):
                    (out / f"{name}-metrics.txt").write_text(c.get(url + "/metrics").text)
                    (out / f"{name}-version.json").write_text(c.get(url + "/version").text + "\n")
                    (out / f"{name}-models.json").write_text(
                        json.dumps(c.get(url + "/v1/models").json(), indent=2) + "\n")
                    h = c.get(url + "/health")
                    info[f"{name}_health"] = {"status": h.status_code, "body": h.text,
                                              "content_type": h.headers.get("content-type")}  # fmt: skip
                    rs = c.post(url + "/reset_prefix_cache")
                    info[f"{name}_reset_prefix_cache"] = {"status": rs.status_code, "body": rs.text[:300]}
                _, sse, _, _ = pd_request(c, p_url, d_url, dict(body, stream=True))
                (out / "decode-sse-stream.txt").write_text(sse)
                extras = dict(body, return_token_ids=True, logprobs=2)
                r = c.post(d_url + "/v1/completions", json=extras)
                info["completions_return_token_ids_logprobs"] = {"status": r.status_code, "json": r.json()}
                r = c.post(d_url + "/v1/chat/completions", json={
                    "model": model_id, "messages": [{"role": "user", "content": "kalo mi"}],
                    "max_tokens": 8, "temperature": 0})  # fmt: skip
                info["chat_completions"] = {"status": r.status_code, "json": r.json()}
        info["idle_cpu_percent_after_requests"] = {"prefill": idle_cpu_percent(p.proc.pid),
                                                   "decode": idle_cpu_percent(d.proc.pid)}  # fmt: skip
        info["tree_sizes"] = {"prefill": len(tree_pids(p.proc.pid)), "decode": len(tree_pids(d.proc.pid))}
    finally:
        info["stop_s"] = {"prefill": p.stop(), "decode": d.stop()}
        info["exit_codes"] = {"prefill": p.proc.returncode, "decode": d.proc.returncode}
        info["leftover_pids"], info["all_gone_after_s"] = wait_all_gone(token)
    return info


def probe(args: argparse.Namespace, model: Path, work: Path, extra: list[str], name: str,
          port: int | None = None, timeout: float = 240.0) -> dict[str, Any]:  # fmt: skip
    token = uuid.uuid4().hex
    port = port or free_port()
    argv = [str(Path(args.venv) / "bin" / "vllm"), "serve", str(model), "--host", HOST, "--port", str(port),
            "--block-size", "128", "--max-model-len", "512", "--enforce-eager", "--seed", "0", *extra]  # fmt: skip
    env = dict(os.environ, **cpu.cpu_server_env(work), VLLM_PORT=str(free_port()), **{TOKEN_VAR: token})
    s = Server(name, argv, env, work / f"probe-{name}.log")
    result: dict[str, Any] = {"extra_args": extra}
    try:
        result["healthy_after_s"] = wait_healthy(s, f"http://{HOST}:{port}", timeout)
    except RuntimeError as exc:
        result["error"] = str(exc)
    result["exit_code"] = s.proc.returncode
    result["elapsed_s"] = round(time.monotonic() - s.t0, 1)
    s.stop()
    lines = s.log.read_text(errors="replace").splitlines()
    result["log_tail"] = [ln for ln in lines if "Error" in ln or "error" in ln or "backend" in ln.lower()][-8:]
    result["leftover_pids"], result["all_gone_after_s"] = wait_all_gone(token)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=str(REPO / ".venv-vllm"))
    parser.add_argument("--out", default=str(REPO / "tests" / "data" / "vllm-cpu"))
    parser.add_argument("--work", default="/tmp/pdserve-smoke")
    parser.add_argument("--keep-prog-thread", action="store_true")
    parser.add_argument("--probes", action="store_true")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = tiny_model.ensure_tiny_model("llama", Path(args.venv) / "bin" / "python")
    print(f"model {model} ({time.monotonic() - t0:.1f} s)", flush=True)
    info = run_pair(args, model, work, out)
    print(json.dumps({k: v for k, v in info.items() if k not in ("pd_response_decode",)}, indent=1, default=str))
    name = "summary-keep-prog-thread.json" if args.keep_prog_thread else "summary.json"
    if args.probes:
        busy = socket.socket()
        busy.bind((HOST, 0))
        busy.listen()
        info["probe_port_taken"] = probe(args, model, work, [], "port-taken", port=busy.getsockname()[1])
        busy.close()
        for backend in ("BOGUS_BACKEND", "CPU_ATTN", "cpu_attn", "TRITON_ATTN", "FLASH_ATTN"):
            info[f"probe_attention_backend_{backend}"] = probe(
                args, model, work, ["--attention-backend", backend], f"attn-{backend}")
            print(backend, json.dumps(info[f"probe_attention_backend_{backend}"], indent=1), flush=True)
        print("port-taken", json.dumps(info["probe_port_taken"], indent=1))
    (out / name).write_text(json.dumps(info, indent=2, default=str) + "\n")
    return 0 if not info["leftover_pids"] else 1


if __name__ == "__main__":
    sys.exit(main())
