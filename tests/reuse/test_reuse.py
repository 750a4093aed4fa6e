"""``--pd-reuse`` (issue 19) as users meet it: consecutive real pytest sessions against real simulator processes.

Each case runs inner pytest sessions (``pytester``, in subprocesses) with a private reuse dir and lease dir, and
then checks what is left with the same helpers as the lifecycle tests: marked processes (every process an
inner session starts, the keeper included, carries ``PDSERVE_TEST_MARK``), held leases, state files. The
attacks: a keeper or a server killed while kept, a planted or garbage state file, a reuse dir others can write,
a second run wanting the kept cluster's GPUs, a concurrent claim, CI.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import _reuse
import pytest
from _children import die_with_parent
from _pdsession import GONE_WITHIN_S, Inner, live_procs, unheld_locks, wait_for
from _reuse import UP, claimed_run, kept_one, run_reuse, states, stop_all

from pytest_pdserve import cli
from pytest_pdserve.common import created
from pytest_pdserve.common.logfile import open_append, write_replace
from pytest_pdserve.engines.engine import resolve_engine
from pytest_pdserve.machine.leases import acquire_ports
from pytest_pdserve.reuse import adopt, client, dirs, fingerprint, keeper
from pytest_pdserve.reuse.state import KeptServer, KeptState
from pytest_pdserve.running.proctree import SERVER_TOKEN_ENV, alive_as, read_stat

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

# The shared fixtures (tests/_reuse.py): one copy, bound here so pytest finds them.
inner = _reuse.inner
reuse_dir = _reuse.reuse_dir

# Read before clean_pdserve_env removes them: the real-vLLM case runs the vLLM and model cache CI set up.
REAL_VLLM = os.environ.get("PDSERVE_VLLM_EXECUTABLE", "vllm")
MODEL_CACHE = os.environ.get("PDSERVE_CACHE_DIR")


def test_second_run_attaches_to_the_kept_cluster_and_stop_all_leaves_nothing(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    first = run_reuse(inner, reuse_dir)
    first.assert_outcomes(passed=1)
    first.stdout.fnmatch_lines(["*pdserve: reuse: kept pd-1-* for the next --pd-reuse run*"])
    [state] = states(reuse_dir)
    kept_pids = {s["pid"] for s in [*state["servers"], state["proxy"]]}
    assert all(read_stat(pid) is not None for pid in kept_pids), "kept servers must outlive the first pytest"
    with pytest.raises(AssertionError, match="still held"):
        unheld_locks(inner.lease_dir)  # the kept cluster's leases stay held while it runs

    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*reuse on (idle ttl 900s*kept clusters: {state['id']} (pd, *old)*"])
    second.stdout.fnmatch_lines([f"*cluster pd (sim, 1P x 1D) reused kept cluster {state['id']}, *old*"])
    second.stdout.fnmatch_lines([f"*pdserve: reused {state['id']}, *old (its start took *s of cluster starts saved*"])
    infos = inner.infos()
    first_info = next(i for i in infos if i["reused"] is None)
    second_info = next(i for i in infos if i["reused"] is not None)
    assert second_info["reused"] == state["id"]
    assert [s["port"] for s in first_info["servers"]] == [s["port"] for s in second_info["servers"]]
    # The second run attached: it started no server (no process of its own behind the handles).
    assert all(s["pid"] is None for s in second_info["servers"])
    assert {s["pid"] for s in first_info["servers"]} == kept_pids

    listed = subprocess.run(
        [sys.executable, "-m", "pytest_pdserve.cli", "--dir", str(reuse_dir), "ls"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    assert state["id"] in listed.stdout, listed.stdout
    assert "1P x 1D" in listed.stdout, listed.stdout
    stop_all(reuse_dir, inner)


def test_a_different_configuration_starts_fresh_and_says_why(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    kept = kept_one(inner, reuse_dir)
    second = run_reuse(inner, reuse_dir, "--pd-seed=7")
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*pd: starting a fresh cluster: kept cluster {kept['id']} differs in setting.seed*"])
    assert len(states(reuse_dir)) == 2  # both kept: each fits its own configuration
    third = run_reuse(inner, reuse_dir, "--pd-seed=7")
    third.stdout.fnmatch_lines(["*reused kept cluster*"])
    stop_all(reuse_dir, inner)


def test_an_idle_cluster_stops_after_the_ttl(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    first = run_reuse(inner, reuse_dir, "--pd-reuse-ttl=1")
    first.assert_outcomes(passed=1)
    # It was kept (said by the run; its state file may be gone already: on a loaded machine the 1 s TTL can end
    # before this process looks), then the keeper stopped it for being idle.
    first.stdout.fnmatch_lines(["*pdserve: reuse: kept * for the next --pd-reuse run*stops after 1s idle*"])
    inner.gone_within()
    assert states(reuse_dir) == []
    unheld_locks(inner.lease_dir)
    assert "idle for 1s" in (reuse_dir / "keeper.log").read_text()


def test_a_killed_keeper_takes_its_servers_down_and_the_next_run_starts_fresh(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    os.kill(state["keeper"]["pid"], signal.SIGKILL)
    inner.gone_within()  # the keeper's guard stopped the kept servers
    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*kept cluster {state['id']}'s keeper (pid {state['keeper']['pid']}) is gone*"])
    assert [s["id"] for s in states(reuse_dir)] != [state["id"]]
    stop_all(reuse_dir, inner)


def test_sigterm_to_the_keeper_stops_its_clusters(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    os.kill(state["keeper"]["pid"], signal.SIGTERM)
    inner.gone_within()
    assert states(reuse_dir) == []
    unheld_locks(inner.lease_dir)


def test_a_run_killed_while_it_holds_a_kept_cluster_leaves_it_for_the_next(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    inner.pytester.makepyfile(
        """
        import time

        def test_up(pd_cluster, pdinfo):
            pdinfo(pd_cluster, reused=pd_cluster.reused.kept_id if pd_cluster.reused else None)
            time.sleep(600)  # timing: until the outer test kills this run
        """
    )
    for p in inner.info_dir.glob("*.json"):
        p.unlink()
    with inner.popen("--pd-reuse", f"--pd-reuse-dir={reuse_dir}") as proc:
        assert inner.wait_info()["reused"] == state["id"]
        os.killpg(proc.pid, signal.SIGKILL)  # the worst moment: mid-test, holding the claim
        proc.wait(30)
    # The claim died with it; the kept servers did not (they are the keeper's, not that run's watchdog's).
    kept_pids = [s["pid"] for s in [*state["servers"], state["proxy"]]]
    assert all(read_stat(pid) is not None for pid in kept_pids)
    inner.pytester.makepyfile(UP)
    third = run_reuse(inner, reuse_dir)
    third.assert_outcomes(passed=1)
    third.stdout.fnmatch_lines([f"*reused kept cluster {state['id']}*"])
    stop_all(reuse_dir, inner)


def test_a_keeper_killed_under_a_run_that_uses_its_cluster_fails_that_run_clearly(
    inner: Inner, reuse_dir: Path
) -> None:
    with claimed_run(inner, reuse_dir) as (state, proc, go):
        os.kill(state["keeper"]["pid"], signal.SIGKILL)  # its guard stops the servers this run is using
        pids = [(s["pid"], s["starttime"]) for s in state["servers"]]
        wait_for(
            lambda: not any(alive_as(*p) for p in pids), GONE_WITHIN_S, "kept servers stopped by the keeper's guard"
        )
        go.touch()
        assert proc.wait(60) == 1
    out = inner.output()
    # The reused cluster's servers are not this run's processes: the death is seen by /health, and said so.
    assert re.search(r"cluster 'pd': (prefill|decode)-0 stopped answering \(GET /health", out), out[-3000:]
    inner.gone_within()
    unheld_locks(inner.lease_dir)


def test_a_kept_cluster_left_asleep_is_not_reused(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner.pytester.makepyfile(
        """
        import os

        def test_sleep(pd_cluster_factory):
            cluster = pd_cluster_factory(extra_args=("--enable-sleep-mode",))
            cluster.complete("a " * 8, max_tokens=1)
            if os.environ.get("SLEEP_IT"):
                for s in (*cluster.prefill, *cluster.decode):
                    assert s.client.post("/sleep?level=1").status_code == 200  # and never woken
        """
    )
    monkeypatch.setenv("SLEEP_IT", "1")
    state = kept_one(inner, reuse_dir)
    monkeypatch.delenv("SLEEP_IT")
    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*kept cluster {state['id']} failed its check (prefill-0 is asleep*); stopped it*"])
    stop_all(reuse_dir, inner)


RUNTIME_CHANGES = """
import json, os
import httpx
from _lora import write_zero_adapter

def test_lora(pd_cluster_factory, pdinfo, tmp_path):
    cluster = pd_cluster_factory(env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, extra_args=("--enable-lora",))
    decode = cluster.decode[0].client
    models = [m["id"] for m in decode.get("/v1/models").json()["data"]]
    assert models == [cluster.model], models  # no adapter an earlier run loaded
    script = {}
    if os.environ.get("LOAD_IT"):
        path = str(write_zero_adapter(cluster.model, tmp_path / "sql-lora"))

        def post(route, body):
            r = decode.post(route, json=body)
            is_json = r.headers.get("content-type", "").startswith("application/json")
            return [r.status_code, r.json()["error"] if is_json else r.text]

        script["load"] = post("/v1/load_lora_adapter", {"lora_name": "sql-lora", "lora_path": path})
        script["again"] = post("/v1/load_lora_adapter", {"lora_name": "sql-lora", "lora_path": path})
        script["missing"] = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path + "-missing"})
        script["no_path"] = post("/v1/load_lora_adapter", {"lora_name": "x"})
        conflict = post("/v1/load_lora_adapter", {"lora_name": cluster.model, "lora_path": path})
        script["conflict"] = [conflict[0], conflict[1]["type"]]  # its message names the model (sanitized or not)
        script["unload_missing"] = post("/v1/unload_lora_adapter", {"lora_name": "nope"})
        script["name_list"] = post("/v1/load_lora_adapter", {"lora_name": ["a"], "lora_path": path})
        script["unload_int"] = post("/v1/unload_lora_adapter", {"lora_name": 7})
        script["empty_name"] = post("/v1/load_lora_adapter", {"lora_name": "", "lora_path": path})
        script["model_obj"] = post("/v1/completions", {"model": {"m": 1}, "prompt": [5], "max_tokens": 1})
        cards = [c for c in decode.get("/v1/models").json()["data"] if c["id"] != cluster.model]
        script["cards"] = [[c["id"], c["root"] == path, c["parent"] == cluster.model, c["max_model_len"]]
                           for c in cards]
        r = decode.post("/v1/completions", json={"model": "sql-lora", "prompt": [5, 6, 7], "max_tokens": 2,
                                                 "ignore_eos": True})
        script["complete"] = [r.status_code, r.json()["model"], r.json()["usage"]["completion_tokens"]]
        # sql-lora stays loaded: the next run must not be handed this cluster

        def call(client, method, route, **kw):
            try:
                r = client.request(method, route, **kw)
            except httpx.TimeoutException:
                return "timeout"
            return [r.status_code, r.json()]

        prefill = cluster.prefill[0].client
        script["is_paused"] = call(decode, "GET", "/is_paused")
        script["weight_info"] = call(decode, "GET", "/weight_info")
        script["pause_bad_mode"] = call(decode, "POST", "/pause", params={"mode": "bogus"})
        script["pause_bad_clear"] = call(decode, "POST", "/pause", params={"clear_cache": "perhaps"})
        script["sleep_bad_level"] = call(decode, "POST", "/sleep", params={"level": "5"})
        script["sleep_level0"] = call(decode, "POST", "/sleep", params={"level": "0"})
        script["after_sleep0"] = [call(decode, "GET", "/is_sleeping"), call(decode, "GET", "/is_paused")]
        script["wake_scheduling"] = call(decode, "POST", "/wake_up", params={"tags": "scheduling"})
        script["pause_keep"] = call(decode, "POST", "/pause", params={"mode": "keep"})
        script["resume"] = call(decode, "POST", "/resume")
        script["after_resume"] = [call(decode, "GET", "/is_sleeping"), call(decode, "GET", "/is_paused")]
        script["uwv_missing"] = call(decode, "POST", "/update_weight_version", json={})
        script["uwv_int"] = call(decode, "POST", "/update_weight_version", json={"new_version": 3})
        script["uwv"] = call(decode, "POST", "/update_weight_version", json={"new_version": "v2"})
        script["weight_info_after"] = call(decode, "GET", "/weight_info")
        other = [decode.post(route) for route in ("/reset_mm_cache", "/reset_encoder_cache")]
        script["reset_other"] = [[r.status_code, r.text] for r in other]
        script["reset_bad_bool"] = call(decode, "POST", "/reset_prefix_cache", params={"reset_external": "maybe"})
        script["reset_external"] = call(decode, "POST", "/reset_prefix_cache", params={"reset_external": "true"})
        script["pause"] = call(prefill, "POST", "/pause")
        script["after_pause"] = [call(prefill, "GET", "/is_sleeping"), call(prefill, "GET", "/is_paused")]
        # timing: a paused server holds the request however long it waits
        script["complete_paused"] = call(prefill, "POST", "/v1/completions", timeout=1.5,
                                         json={"model": cluster.model, "prompt": [5, 6, 7], "max_tokens": 1})
        # prefill-0 stays paused and decode-0 at weight version v2: the next run must say so too
    pdinfo(cluster, reused=cluster.reused.kept_id if cluster.reused else None, script=script)
"""

#: What vLLM for CPU 0.32 answers to RUNTIME_CHANGES' requests (measured; the simulator must answer the same).
RUNTIME_CHANGES_ANSWERS = {
    "load": [200, "Success: LoRA adapter 'sql-lora' added successfully."],
    "again": [400, {"message": "The lora adapter 'sql-lora' has already been loaded. If you want to load the adapter "
                               "in place, set 'load_inplace' to True.", "type": "InvalidUserInput", "param": None,
                    "code": 400}],
    "missing": [404, {"message": "Loading lora x failed: No adapter found for <path>", "type": "NotFoundError",
                      "param": None, "code": 404}],
    "no_path": [400, {"message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', 'msg': "
                                 "'Field required', 'input': '<dict of 1 items>'}", "type": "Bad Request",
                      "param": "body.lora_path", "code": 400}],
    "conflict": [400, "InvalidUserInput"],
    "unload_missing": [404, {"message": "The lora adapter 'nope' cannot be found.", "type": "NotFoundError",
                             "param": None, "code": 404}],
    "name_list": [400, {"message": "1 validation error:\n  {'type': 'string_type', 'loc': 'body.lora_name', 'msg': "
                                   "'Input should be a valid string', 'input': '<list of 1 items>'}",
                        "type": "Bad Request", "param": "body.lora_name", "code": 400}],
    "unload_int": [400, {"message": "1 validation error:\n  {'type': 'string_type', 'loc': 'body.lora_name', 'msg': "
                                    "'Input should be a valid string', 'input': '7'}",
                         "type": "Bad Request", "param": "body.lora_name", "code": 400}],
    "empty_name": [400, {"message": "Both 'lora_name' and 'lora_path' must be provided.", "type": "InvalidUserInput",
                         "param": None, "code": 400}],
    "model_obj": [400, {"message": "1 validation error:\n  {'type': 'string_type', 'loc': 'body.model', 'msg': "
                                   "'Input should be a valid string', 'input': '<dict of 1 items>'}",
                        "type": "Bad Request", "param": "body.model", "code": 400}],
    "cards": [["sql-lora", True, True, None]],
    "complete": [200, "sql-lora", 2],
    "is_paused": [200, {"is_paused": False}],
    "weight_info": [200, {"weight_version": "default"}],
    "pause_bad_mode": [400, {"error": {"message": "1 validation error:\n  {'type': 'literal_error', 'loc': "
                                                  "'query.mode', 'msg': \"Input should be 'abort', 'wait' or 'keep'\", "
                                                  "'input': 'bogus', 'ctx': {'expected': "
                                                  "\"'abort', 'wait' or 'keep'\"}}",
                                       "type": "Bad Request", "param": "query.mode", "code": 400}}],
    "pause_bad_clear": [400, {"error": {"message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': "
                                                   "'query.clear_cache', 'msg': 'Input should be a valid boolean, "
                                                   "unable to interpret input', 'input': 'perhaps'}",
                                        "type": "Bad Request", "param": "query.clear_cache", "code": 400}}],
    "sleep_bad_level": [400, {"error": {"message": "1 validation error:\n  {'type': 'less_than_equal', 'loc': "
                                                   "'query.level', 'msg': 'Input should be less than or equal to 2', "
                                                   "'input': '5', 'ctx': {'le': 2}}",
                                        "type": "Bad Request", "param": "query.level", "code": 400}}],
    "sleep_level0": [200, {"status": "sleeping", "level": 0}],
    "after_sleep0": [[200, {"is_sleeping": True}], [200, {"is_paused": True}]],
    "wake_scheduling": [200, {"status": "awake", "tags": ["scheduling"]}],
    "pause_keep": [200, {"status": "paused"}],
    "resume": [200, {"status": "resumed"}],
    "after_resume": [[200, {"is_sleeping": False}], [200, {"is_paused": False}]],
    "uwv_missing": [400, {"error": {"message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.new_version', "
                                               "'msg': 'Field required', 'input': 'None'}",
                                    "type": "Bad Request", "param": "body.new_version", "code": 400}}],
    "uwv_int": [400, {"error": {"message": "1 validation error:\n  {'type': 'string_type', 'loc': 'body.new_version', "
                                           "'msg': 'Input should be a valid string', 'input': '3'}",
                                "type": "Bad Request", "param": "body.new_version", "code": 400}}],
    "uwv": [200, {"success": True, "new_version": "v2"}],
    "weight_info_after": [200, {"weight_version": "v2"}],
    "reset_other": [[200, ""], [200, ""]],
    "reset_bad_bool": [400, {"error": {"message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': "
                                                  "'query.reset_external', 'msg': 'Input should be a valid boolean, "
                                                  "unable to interpret input', 'input': 'maybe'}",
                                       "type": "Bad Request", "param": "query.reset_external", "code": 400}}],
    "reset_external": [200, {"success": True}],  # NixlConnector keeps no cache of its own: nothing fails
    "pause": [200, {"status": "paused"}],
    "after_pause": [[200, {"is_sleeping": True}], [200, {"is_paused": True}]],
    "complete_paused": "timeout",  # a paused scheduler queues the request until /resume
}  # fmt: skip


@pytest.mark.timeout(900)  # on real vLLM: two cluster starts on 2 cores
@pytest.mark.parametrize("engine", ["sim", "vllm"])
def test_a_kept_cluster_a_test_changed_at_run_time_is_not_reused(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """What a test can change over HTTP and the prefix-cache reset does not undo: a LoRA adapter it loaded (vLLM
    lists it in /v1/models and serves it by name), a paused scheduler (dev mode's /pause: the next run's requests
    would hang) and another weight version (an RL trainer's /update_weight_version). A kept cluster left so is
    refused, every change named. The same script runs on both engines and must answer as vLLM does."""
    extra = [f"--pd-engine={engine}"]
    timeout = 120.0
    if engine == "vllm":
        if not resolve_engine("vllm", REAL_VLLM, python=sys.executable)[2]:
            pytest.skip(f"real vLLM not installed ({REAL_VLLM!r}); CI installs it with scripts/install-vllm-cpu.sh")
        extra.append(f"--pd-vllm-executable={REAL_VLLM}")
        if MODEL_CACHE:  # where CI keeps the tiny model (clean_pdserve_env removed it)
            monkeypatch.setenv("PDSERVE_CACHE_DIR", MODEL_CACHE)
        timeout = 600.0
    inner.pytester.makepyfile(RUNTIME_CHANGES, _lora=(Path(__file__).parents[1] / "_lora.py").read_text())
    monkeypatch.setenv("LOAD_IT", "1")
    run_reuse(inner, reuse_dir, *extra, timeout=timeout).assert_outcomes(passed=1)
    [state] = states(reuse_dir)
    [first] = inner.infos()
    assert first["script"] == RUNTIME_CHANGES_ANSWERS, json.dumps(first["script"], indent=1)
    monkeypatch.delenv("LOAD_IT")
    if engine == "vllm":
        # What only real vLLM can show ends with the check: vLLM's own answers (above) and the kept real cluster
        # refused and stopped. The fresh start after it is the simulator half's; here it is cut short after 1 s
        # (a second real start on 2 cores: ~100 s of the CI's real-vLLM tier).
        extra.append("--pd-startup-timeout=1")
    second = run_reuse(inner, reuse_dir, *extra, timeout=timeout)
    if engine == "vllm":
        second.assert_outcomes(failed=1)  # the plugin fails a test whose cluster failed to start
        second.stdout.fnmatch_lines(["*ServerStartupTimeout: *: not ready after *s (still waiting for*"])
    else:
        second.assert_outcomes(passed=1)  # its test found no sql-lora: a fresh cluster
    second.stdout.fnmatch_lines(
        [f"*kept cluster {state['id']} failed its check (prefill-0 is asleep or paused (POST /sleep or /pause without"
         " /wake_up or /resume); decode-0 now also serves sql-lora (a LoRA adapter loaded at run time: POST"
         " /v1/load_lora_adapter); decode-0 runs weight version 'v2', not 'default' as at its start*"]
    )  # fmt: skip
    assert [i["reused"] for i in inner.infos()] == [None] * (1 if engine == "vllm" else 2)  # neither run attached
    stop_all(reuse_dir, inner)


def test_state_files_hold_no_secret(inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-reuse-secret-0123")
    inner.pytester.makepyfile(
        """
        def test_up(pd_cluster_factory):
            c = pd_cluster_factory(env={"HF_TOKEN": "hf_secret_token_4567"})
            assert c.complete("a " * 8, max_tokens=1)["choices"]
        """
    )
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    text = "".join(p.read_text() for p in reuse_dir.glob("*.json"))
    assert text, "nothing kept"
    assert "sk-reuse-secret-0123" not in text
    assert "hf_secret_token_4567" not in text
    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)  # the key came from this run's settings: the adopted servers accept it
    second.stdout.fnmatch_lines(["*reused kept cluster*"])
    stop_all(reuse_dir, inner)


def test_old_run_logs_are_pruned_but_not_a_kept_clusters(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    runs = [created.make_dir(logs / f"2026010{i}-000000-{i}-0000000{i}", 0o700, created.RUN_LOGS) for i in range(8)]
    for r in runs:
        os.close(open_append(r / "pdserve.log"))  # as pdserve writes its logs: recorded in the run's manifest
        os.utime(r, (0, 0))  # old enough
    kept_log = runs[0] / "pd-1-prefill-0.log"
    state = {
        "id": "k", "fingerprint": {}, "created": 0,
        "servers": [{"pid": 1, "pgid": 1, "starttime": 0, "token": "t", "url": "u", "name": "prefill-0",
                     "log_path": str(kept_log)}],
        "proxy": {"pid": 1, "pgid": 1, "starttime": 0, "token": "t", "url": "u", "name": "proxy", "log_path": ""},
        "keeper": {"pid": 1, "starttime": 0, "socket": "s", "ttl": 1, "since": 0},
    }  # fmt: skip
    (tmp_path / "k.json").write_text(json.dumps(state))
    removed, left = dirs.prune_run_logs(tmp_path, keep=5)
    assert sorted(removed) == runs[1:3]
    assert runs[0].exists()  # a kept cluster still logs there
    assert left == []


def test_a_kept_server_that_dies_stops_its_cluster(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    prefill = state["servers"][0]
    os.killpg(prefill["pgid"], signal.SIGKILL)
    inner.gone_within()  # decode and proxy too: a cluster without its prefill is no cluster
    assert states(reuse_dir) == []
    unheld_locks(inner.lease_dir)
    assert f"stopped {state['id']} (prefill-0 (pid {prefill['pid']}) is gone)" in (reuse_dir / "keeper.log").read_text()


def test_a_kept_cluster_whose_state_file_is_removed_stops(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    [path] = reuse_dir.glob("*.json")
    path.unlink()  # `rm -rf ~/.cache/pytest-pdserve`: no run could find it again
    inner.gone_within()
    unheld_locks(inner.lease_dir)
    assert "its state file is gone" in (reuse_dir / "keeper.log").read_text()


def test_stopping_a_claimed_cluster_leaves_the_keepers_other_clusters(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(
        """
        def test_two(pd_cluster, pd_cluster_factory):
            assert pd_cluster_factory(name="other", max_model_len=1024).complete("a " * 8, max_tokens=1)["choices"]
        """
    )
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    kept = {k.spec_name: k for k in client.list_kept(reuse_dir)}
    assert sorted(kept) == ["other", "pd"]
    held = client.claim(kept["pd"])
    assert held is not None
    held.stop()  # what a run does for pd_cluster_factory.stop(spec) on a reused cluster
    assert [k.spec_name for k in client.list_kept(reuse_dir)] == ["other"]
    assert client.keeper_info(kept["other"]) != {}, "the keeper must still serve its other cluster"
    stop_all(reuse_dir, inner)


def test_a_cluster_another_run_holds_is_not_shared(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    [kept] = client.list_kept(reuse_dir)
    held = client.claim(kept)
    assert held is not None
    try:
        second = run_reuse(inner, reuse_dir)
        second.assert_outcomes(passed=1)
        second.stdout.fnmatch_lines([f"*starting a fresh cluster: kept cluster {kept.id} is in use by another run*"])
    finally:
        held.release()
    stop_all(reuse_dir, inner)


def test_prefix_cache_is_reset_when_a_run_attaches(inner: Inner, reuse_dir: Path) -> None:
    # With --pd-cache-salt=off the same prompt would hit the cache the previous run warmed, but for the reset.
    inner.pytester.makepyfile(
        """
        PROMPT = "the same long prompt " * 40

        def hits(cluster):
            return sum(v for _, v in cluster.prefill[0].metrics().series("vllm:prefix_cache_hits_total").items())

        def test_cold(pd_cluster, pdinfo):
            before = hits(pd_cluster)
            pd_cluster.complete(PROMPT, max_tokens=1)
            pdinfo(pd_cluster, hits=hits(pd_cluster) - before, reused=pd_cluster.reused is not None)
        """
    )
    run_reuse(inner, reuse_dir, "--pd-cache-salt=off").assert_outcomes(passed=1)
    run_reuse(inner, reuse_dir, "--pd-cache-salt=off").assert_outcomes(passed=1)
    by_reuse = {i["reused"]: i["hits"] for i in inner.infos()}
    assert by_reuse == {False: 0, True: 0}, by_reuse
    stop_all(reuse_dir, inner)


def test_a_run_that_waits_for_the_kept_gpus_gets_them(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir, "--pd-simulate-gpus=2")
    # A run without --pd-reuse needs both GPUs: it waits, says so, and the keeper gives them up.
    other = inner.run("--pd-simulate-gpus=2", "--pd-gpu-wait-timeout=60")
    other.assert_outcomes(passed=1)
    other.stdout.fnmatch_lines(["*waiting for*GPU*kept for reuse*"])
    assert "another run waits for its leases (GPUs or a fixed port)" in (reuse_dir / "keeper.log").read_text()
    assert state["id"] not in [s["id"] for s in states(reuse_dir)]
    inner.gone_within()
    unheld_locks(inner.lease_dir)


def test_a_run_that_skips_busy_gpus_still_gets_the_kept_ones(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    run_reuse(inner, reuse_dir, "--pd-simulate-gpus=2").assert_outcomes(passed=1)
    other = inner.run("--pd-simulate-gpus=2", "--pd-gpu-wait=skip")
    other.assert_outcomes(passed=1)  # not skipped: only a kept cluster held them
    assert states(reuse_dir) == []


def test_a_claimed_cluster_makes_room_for_another_spec(inner: Inner, reuse_dir: Path) -> None:
    # The second run claims the kept 2-GPU cluster, then needs both GPUs for another spec: its own LRU rule must
    # stop the claimed one (a claimed cluster is never stopped for "wanted" GPUs, so waiting would wait forever).
    inner.pytester.makepyfile(
        """
        def test_a(pd_cluster):
            assert pd_cluster.complete("a " * 8, max_tokens=1)["choices"]

        def test_b(pd_cluster_factory):
            other = pd_cluster_factory(name="other", max_model_len=1024)
            assert other.complete("b " * 8, max_tokens=1)["choices"]
        """
    )
    run_reuse(inner, reuse_dir, "--pd-simulate-gpus=2", "-k", "not test_b").assert_outcomes(passed=1)
    second = run_reuse(inner, reuse_dir, "--pd-simulate-gpus=2", "--pd-gpu-wait-timeout=30")
    second.assert_outcomes(passed=2)
    second.stdout.fnmatch_lines(["*reused kept cluster*", "*stopping cluster pd to free its GPUs*"])
    assert [s["spec_name"] for s in states(reuse_dir)] == ["other"]
    stop_all(reuse_dir, inner)


def test_factory_stop_of_a_reused_cluster_stops_it(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    inner.pytester.makepyfile(
        """
        def test_stop(pd_cluster, pd_cluster_factory):
            assert pd_cluster.reused is not None
            pd_cluster_factory.stop(pd_cluster.spec)
        """
    )
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    assert "pdserve stop" in (reuse_dir / "keeper.log").read_text()
    assert state["id"] not in [s["id"] for s in states(reuse_dir)]
    stop_all(reuse_dir, inner)


def test_xdist_workers_each_claim_their_own_kept_cluster(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("i", range(4))
        def test_up(pd_cluster, pdinfo, i):
            pdinfo(pd_cluster, reused=pd_cluster.reused.kept_id if pd_cluster.reused else None)
        """
    )
    run_reuse(inner, reuse_dir, "-n", "2").assert_outcomes(passed=4)
    first_ids = {s["id"] for s in states(reuse_dir)}
    assert len(first_ids) == 2  # one cluster per worker
    for p in inner.info_dir.glob("*.json"):
        p.unlink()
    run_reuse(inner, reuse_dir, "-n", "2").assert_outcomes(passed=4)
    reused = {i["reused"] for i in inner.infos()}
    assert reused == first_ids, reused  # each worker attached to a different kept cluster, none started its own
    stop_all(reuse_dir, inner)


def test_export_env_sessions_reuse_the_kept_cluster(inner: Inner, reuse_dir: Path) -> None:
    # vLLM's unmodified modules read the exported addresses at import time: the second run exports the kept ones.
    inner.pytester.makepyfile(
        test_module="""
        import json, os, uuid
        from pathlib import Path

        PORTS = {k: os.environ[k] for k in ("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT")}

        def test_ports():
            (Path(os.environ["PDINFO_DIR"]) / f"{uuid.uuid4().hex}.json").write_text(json.dumps(PORTS))
        """
    )
    run_reuse(inner, reuse_dir, "--pd-export-env").assert_outcomes(passed=1)
    second = run_reuse(inner, reuse_dir, "--pd-export-env")
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(["*reused kept cluster*"])
    first_ports, second_ports = inner.infos()
    assert first_ports == second_ports
    stop_all(reuse_dir, inner)


def test_a_fixed_proxy_port_held_by_a_kept_cluster_is_given_up_to_a_run_that_needs_it(
    inner: Inner, reuse_dir: Path
) -> None:
    with acquire_ports(inner.pytester.path / "probe-leases", 1) as probe:
        port = probe.base
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir, f"--pd-proxy-port={port}")
    assert state["proxy"]["url"].endswith(f":{port}")
    other = inner.run(f"--pd-proxy-port={port}")  # no reuse: it needs that port, and only a keeper holds it
    other.assert_outcomes(passed=1)
    assert "another run waits for its leases" in (reuse_dir / "keeper.log").read_text()
    assert states(reuse_dir) == []
    inner.gone_within()
    unheld_locks(inner.lease_dir)


def test_ci_refuses_reuse_unless_forced(inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inner.pytester.makepyfile(UP)
    monkeypatch.setenv("CI", "true")
    refused = run_reuse(inner, reuse_dir)
    refused.assert_outcomes(passed=1)
    refused.stdout.fnmatch_lines(["*pdserve: reuse off: refused because CI=true*--pd-reuse-mode=force*"])
    inner.gone_within()
    assert states(reuse_dir) == []
    forced = inner.run("--pd-reuse", "--pd-reuse-mode=force", f"--pd-reuse-dir={reuse_dir}")
    forced.assert_outcomes(passed=1)
    forced.stdout.fnmatch_lines(["*reuse force (CI=true is set)*", "*kept pd-1-*"])
    stop_all(reuse_dir, inner)


# ------------------------------------------------------------------------------------------- hostile input


def test_a_reuse_dir_others_can_write_is_refused(inner: Inner) -> None:
    shared = inner.pytester.path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    inner.pytester.makepyfile(UP)
    result = inner.run("--pd-reuse", f"--pd-reuse-dir={shared}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--pd-reuse: reuse directory {shared} is writable by others (mode 0777)*"])


def test_planted_state_files_are_never_trusted(inner: Inner, reuse_dir: Path) -> None:
    """A file that is no state is named and left alone (pdserve did not write it: common/created.py); a state file
    pdserve wrote that names a bystander as its server and as a keeper that is gone is removed, and nothing is
    signalled."""
    dirs.ensure_reuse_dir(reuse_dir)  # a reuse dir pdserve made
    (reuse_dir / "garbage.json").write_text("{not json")
    # A bystander process, and a state file naming it as server and keeper: nothing may signal it.
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, preexec_fn=die_with_parent
    )
    try:
        me = read_stat(bystander.pid)
        assert me is not None
        fake = {"pid": bystander.pid, "pgid": bystander.pid, "starttime": me.starttime, "token": "nothing-carries-it",
                "url": "http://127.0.0.1:9", "name": "prefill-0", "role": "prefill", "index": 0}  # fmt: skip
        planted = {
            "id": "planted-1", "spec_name": "pd", "created": 0, "fingerprint": {}, "servers": [fake],
            "proxy": {**fake, "name": "proxy", "role": "proxy"},
            "keeper": {"pid": bystander.pid, "starttime": me.starttime + 1, "socket": "x", "ttl": 1, "since": 0},
        }  # fmt: skip
        write_replace(reuse_dir / "planted-1.json", json.dumps(planted).encode())  # as a keeper writes one
        inner.pytester.makepyfile(UP)
        result = run_reuse(inner, reuse_dir)
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["*reuse: left *garbage.json alone: not a kept-cluster state*"])
        assert bystander.poll() is None, "a pid named in a state file was signalled"
        assert (reuse_dir / "garbage.json").read_text() == "{not json"
        assert not (reuse_dir / "planted-1.json").exists()  # its "keeper" is not running: removed
    finally:
        bystander.kill()
        bystander.wait(30)
    (reuse_dir / "garbage.json").unlink()
    stop_all(reuse_dir, inner)


@pytest.mark.parametrize("gated", [True, False])
def test_the_keeper_hands_gpus_back_only_behind_the_release_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    """On real CUDA a kept cluster's GPU lease must stay locked until nvidia-smi lists none of its servers, as at
    pytest's own release: the next run's vLLM checks its memory fraction against what is free."""
    lock_path = tmp_path / "gpu-GPU-x.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    sleepers = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                         preexec_fn=die_with_parent, env={**os.environ, SERVER_TOKEN_ENV: f"tok-{i}"})
        for i in range(2)
    ]  # fmt: skip
    servers = [KeptServer(name=f"s{i}", pid=p.pid, pgid=p.pid, starttime=0, token=f"tok-{i}", url="",
                          log_path=str(tmp_path / "x"))
               for i, p in enumerate(sleepers)]  # fmt: skip
    state = KeptState(id="c-1", fingerprint={}, created=0.0, servers=tuple(servers[:1]), proxy=servers[1],
                      release_gate=("GPU-x",) if gated else None)  # fmt: skip
    polls: list[tuple[set[int], bool]] = []

    def lock_is_free() -> bool:
        probe = os.open(lock_path, os.O_RDWR)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(probe)
        return True

    def fake_rule(uuids: set[str], pids: set[int]) -> bool:  # nvidia-smi lists the servers for three polls
        assert uuids == {"GPU-x"}
        polls.append((set(pids), lock_is_free()))
        return len(polls) > 3

    monkeypatch.setattr(keeper, "pids_off_gpus", fake_rule)
    kept = keeper._Kept(state, [(fd, lock_path)], [], tmp_path / "c-1.json")
    try:
        kept.stop("test", 1.0, keep_logs=True)
    finally:
        for p in sleepers:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    if gated:
        assert len(polls) == 4
        assert all(pids == {p.pid for p in sleepers} for pids, _ in polls)
        assert not any(free for _, free in polls), "the lease was free while nvidia-smi still listed a server"
    else:
        assert polls == []  # no gate off real CUDA
    assert not lock_path.exists()  # released (removed while locked, as a release does)


def test_the_keeper_serves_only_its_own_user(inner: Inner, reuse_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user (setuid)")
    inner.pytester.makepyfile(UP)
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    [kept] = client.list_kept(reuse_dir)
    probe = (
        "import os, socket, sys\n"
        "os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5)\n"
        f"s.connect('\\0' + {kept.socket_name!r}); s.sendall(b'stop *\\n')\n"
        "sys.stdout.write(repr(s.recv(100)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.stdout in ("b''", ""), out  # the keeper closed the connection without an answer
    assert client.list_kept(reuse_dir), "another user's `stop *` stopped our kept cluster"
    assert "refused a connection from uid 65534" in (reuse_dir / "keeper.log").read_text()
    assert live_procs(inner.mark), "the kept cluster must still run"
    stop_all(reuse_dir, inner)


def test_pdserve_stop_without_a_reuse_dir_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "never"
    assert cli.main(["--dir", str(missing), "stop", "--all"]) == 0
    assert cli.main(["--dir", str(missing), "stop", "pd-1"]) == 1
    assert not missing.exists()  # looking never creates it


def test_pdserve_stop_names_what_it_does_not_know(inner: Inner, reuse_dir: Path) -> None:
    reuse_dir.mkdir(mode=0o700)
    out = subprocess.run(
        [sys.executable, "-m", "pytest_pdserve.cli", "--dir", str(reuse_dir), "stop", "nope"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1
    assert "no kept cluster named nope (kept: none)" in out.stderr


# ------------------------------------------------------------------------------------------- pure rules


def _fp(**changes: Any) -> dict[str, str]:
    from pytest_pdserve.cluster import EngineSetup
    from pytest_pdserve.config.commands import EngineInfo
    from pytest_pdserve.config.effective import SessionDefaults
    from pytest_pdserve.engines.vllm_compat import Version
    from pytest_pdserve.spec import ClusterSpec

    base: dict[str, Any] = {
        "spec": ClusterSpec(), "defaults": SessionDefaults(), "model": "m",
        "setup": EngineSetup(EngineInfo("vllm", ("/x/vllm",), Version("0.32.0"), "/x/python")),
        "placement": {"gpus": []}, "proxy_command": None, "environ": {"HOME": "/root", "VLLM_X": "1"},
    }  # fmt: skip
    base.update(changes)
    return fingerprint.fingerprint(**base)


def test_the_fingerprint_names_what_differs_and_holds_no_secret() -> None:
    from pytest_pdserve.config.effective import SessionDefaults

    same = _fp()
    assert fingerprint.differences(same, _fp()) == []
    assert (
        fingerprint.differences(same, _fp(environ={"HOME": "/elsewhere", "VLLM_X": "1"})) == []
    )  # not read by servers
    assert fingerprint.differences(same, _fp(environ={"HOME": "/root", "VLLM_X": "2"})) == ["env.VLLM_X"]
    keyed = _fp(defaults=SessionDefaults(api_key="sk-very-secret-key"))
    assert fingerprint.differences(same, keyed) == ["setting.api_key"]
    assert "sk-very-secret-key" not in json.dumps(keyed)
    assert fingerprint.differences(same, _fp(model="other")) == ["model"]


@pytest.mark.parametrize(
    ("mode", "environ", "enabled"),
    [
        ("off", {}, False),
        ("on", {}, True),
        ("on", {"CI": "true"}, False),
        ("on", {"CI": "0"}, True),
        ("on", {"CI": ""}, True),
        ("on", {"BUILD_NUMBER": "42"}, False),  # Jenkins sets no CI (pytest's own rule counts BUILD_NUMBER)
        ("on", {"CI": "false", "BUILD_NUMBER": "7"}, False),
        ("force", {"CI": "true"}, True),
        ("force", {}, True),
    ],
)
def test_reuse_decision(mode: str, environ: dict[str, str], enabled: bool) -> None:
    # "on" is --pd-reuse (mode local), "force" is --pd-reuse --pd-reuse-mode=force, "off" is neither.
    decided, why = dirs.reuse_decision(mode != "off", "force" if mode == "force" else "local", environ)
    assert decided is enabled
    if not enabled and mode == "on":
        assert "refused because" in why
        assert any(f"{k}={v}" in why for k, v in environ.items()), why


CPU_TIER = """
import json, os
from pytest_pdserve.config.presets import multi_connector_config

def test_tier(pd_cluster_factory, pdinfo):
    cluster = pd_cluster_factory(name="tier", kv_connector="MultiConnector",
                                 kv_connector_extra_config=json.dumps(multi_connector_config(1 << 30, {})))
    prefill = cluster.prefill[0]
    prompt = "tier " * 300  # several blocks: the CPU tier keeps whole blocks
    before = prefill.metrics()
    cluster.complete(prompt, max_tokens=1)
    if os.environ.get("FIRST"):  # the tier works: after a reset of the local cache only, it answers the prompt
        prefill.reset_prefix_cache(reset_external=False)
        cluster.complete(prompt, max_tokens=1)
    host = (prefill.metrics() - before).prompt_tokens_cached_by_source("host")
    pdinfo(cluster, reused=cluster.reused.kept_id if cluster.reused else None, host=host)
"""


def test_a_reused_cluster_starts_with_an_empty_offloading_cpu_tier(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OffloadingConnector keeps a CPU copy of the blocks the local prefix cache drops: vLLM's plain
    ``/reset_prefix_cache`` leaves it (``reset_external`` defaults to false), and the next run's first request
    would load the last run's KV from it. The attach resets it too (``?reset_external=true``)."""
    inner.pytester.makepyfile(CPU_TIER)
    monkeypatch.setenv("FIRST", "1")
    # A simulated GPU: the OffloadingConnector's CPU tier does not run on the CPU platform (rules/connectors.py).
    gpu = "--pd-simulate-gpus=cuda:2"
    run_reuse(inner, reuse_dir, "--pd-cache-salt=off", gpu).assert_outcomes(passed=1)  # vLLM's modules send no salt
    monkeypatch.delenv("FIRST")
    run_reuse(inner, reuse_dir, "--pd-cache-salt=off", gpu).assert_outcomes(passed=1)
    first, second = sorted(inner.infos(), key=lambda i: i["t"])
    assert first["reused"] is None, first
    assert first["host"] > 0, first  # not vacuous: the tier held the prompt
    assert second["reused"] is not None, second
    assert second["host"] == 0, second  # the kept tier was emptied at attach
    stop_all(reuse_dir, inner)


HELD_BLOCKS = """
import os

def test_held(pd_cluster_factory, pdinfo):
    # 40 s: long enough that the blocks are still held when the next run attaches on a loaded machine (with 3 s,
    # then 15 s, the lease ran out between the two runs there at load 12-20, and the attach had nothing to wait for).
    # The attach waits only until the lease ends, so the test costs about the lease, not more.
    cluster = pd_cluster_factory(name="held", kv_connector_extra_config={"kv_lease_duration": 40})
    pdinfo(cluster, reused=cluster.reused.kept_id if cluster.reused else None)
    if os.environ.get("FIRST"):  # a prefill whose KV no decode reads: its blocks stay held for the lease
        cluster.prefill[0].complete("held " * 100, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
"""


def test_the_attach_waits_for_kv_blocks_a_prefill_left_held_instead_of_starting_fresh(
    inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's last prefill-only request (vLLM's edge-case tests send some) leaves its KV blocks held until
    NixlConnector's lease ends (30 s by default; measured on vLLM for CPU: the reset failed until 30.4 s), and a
    prefix-cache reset fails until then. The attach waits for them (bounded by the lease) and says so."""
    inner.pytester.makepyfile(HELD_BLOCKS)
    monkeypatch.setenv("FIRST", "1")
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    monkeypatch.delenv("FIRST")
    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(
        ["*pdserve: reuse: prefill-0 still holds KV blocks (a request left them*waiting up to 45s to reset its prefix*"]
    )
    assert "starting a fresh cluster" not in second.stdout.str()
    assert [i["reused"] is not None for i in sorted(inner.infos(), key=lambda i: i["t"])] == [False, True]
    stop_all(reuse_dir, inner)


@pytest.mark.parametrize(
    ("config", "lease"),
    [
        (None, adopt.DEFAULT_KV_LEASE),
        ({"kv_connector": "NixlConnector"}, adopt.DEFAULT_KV_LEASE),
        ({"kv_connector_extra_config": {"kv_lease_duration": 90}}, 90.0),
        ({"kv_connector_extra_config": {"kv_lease_duration": True}}, adopt.DEFAULT_KV_LEASE),
        ({"kv_connector_extra_config": {"connectors": [{"kv_connector_extra_config": {"kv_lease_duration": 45}},
                                                       {"kv_connector": "OffloadingConnector"}]}}, 45.0),
        ("not json", adopt.DEFAULT_KV_LEASE),
    ],
)  # fmt: skip
def test_the_held_blocks_wait_is_bounded_by_the_servers_own_lease(config: Any, lease: float) -> None:
    argv = ["serve", "m"]
    if config is not None:
        argv += ["--kv-transfer-config", config if isinstance(config, str) else json.dumps(config)]
    assert adopt._kv_lease_seconds(argv) == lease
