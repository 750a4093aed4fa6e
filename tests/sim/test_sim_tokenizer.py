"""A checkpoint directory's tokenizer.json is the simulator's tokenizer (issue 26): /tokenize, /detokenize, usage,
the context-length rule and the prefix cache count the checkpoint's tokens, BOS as its post-processor adds it.

The checkpoint is the tiny Llama real vLLM serves (the `tiny_llama_dir` fixture builds it with the vLLM venv's
python, so these tests are in the `vllm` tier even where only the simulator runs); the last test asks one real
vLLM server on it for the same answers. The refusal without the `tokenizers` package needs no checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pytest_pdserve.engines.cpu import CPU_BLOCK_SIZE, cpu_server_args, cpu_server_env
from pytest_pdserve.engines.engine import resolve_engine
from pytest_pdserve.sim import tokenizer

from ._simproc import Factory, SimServer, child_env, free_port

#: vLLM for CPU starts in 60-170 s on a loaded 2-core machine (measured); the deadline is a generous multiple.
VLLM_READY_S = 480.0

#: Prompts whose token counts differ between the built-in tokenizer and the tiny Llama's (digits, punctuation,
#: runs of spaces, a newline, non-ASCII letters).
PROMPTS = (
    "Hello world",
    "Red Hat is the best company in the world, since 1993.",
    "  two  spaces\nand a newline",
    "caf\u00e9 na\u00efve 12345 \u2713",
)


@pytest.fixture
def real(tiny_llama_dir: Path) -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


def test_the_simulator_counts_with_the_checkpoints_tokenizer(
    sim_factory: Factory, tiny_llama_dir: Path, real: Any
) -> None:
    encode = real.encode
    server: SimServer = sim_factory("--max-model-len", "512", "--enable-prompt-tokens-details",
                                    model=str(tiny_llama_dir)).wait_ready()  # fmt: skip
    bos = real.token_to_id("<s>")
    for prompt in PROMPTS:
        ids = encode(prompt).ids
        assert ids[0] == bos  # the post-processor's BOS
        assert ids != tokenizer.encode(prompt)  # not the built-in tokenizer's ids
        body = server.post("/tokenize", {"prompt": prompt}).json()
        assert (body["count"], body["tokens"]) == (len(ids), ids), prompt
        plain = server.post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
        assert plain["tokens"] == encode(prompt, add_special_tokens=False).ids == ids[1:]
        text = real.decode(ids, skip_special_tokens=False)
        assert text.startswith("<s>")
        assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == text
        usage = server.complete(prompt, max_tokens=1).json()["usage"]
        assert usage["prompt_tokens"] == len(ids)

    # The context-length rule and the prefix cache count the checkpoint's tokens: this prompt is over 512 tokens
    # for the tiny Llama and well under it for the built-in tokenizer.
    long = PROMPTS[1] + " " + " ".join([PROMPTS[1]] * 14)
    n = len(encode(long).ids)
    assert len(tokenizer.encode(long)) < 512 < n
    refused = server.complete(long, max_tokens=1)
    assert refused.status_code == 400, refused.text
    assert "maximum context length is 512 tokens" in refused.text
    fits = " ".join([PROMPTS[1]] * 6)  # 2 x the same prompt: the second hits every full 16-token block but the last
    n = len(encode(fits).ids)
    assert server.complete(fits, max_tokens=1).status_code == 200
    details = server.complete(fits, max_tokens=1).json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == (n - 1) // 16 * 16


def test_a_checkpoint_tokenizer_without_the_tokenizers_package_is_refused_at_start(
    sim_factory: Factory, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
              "torch_dtype": "float32", "max_position_embeddings": 2048, "vocab_size": 2048}  # fmt: skip
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "tokenizer.json").write_text("{}")
    hidden = tmp_path / "no-tokenizers" / "tokenizers"  # shadows the installed package: its import fails
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'tokenizers'\")\n")
    server: SimServer = sim_factory(model=str(checkpoint), env={"PYTHONPATH": str(hidden.parent)})
    assert server.wait_exit() == 1
    assert (
        f"model {checkpoint}: {checkpoint / 'tokenizer.json'} needs the optional 'tokenizers' package "
        "(pip install tokenizers)"
    ) in server.log()


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + VLLM_READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode} before ready:\n{log.read_text(errors='replace')[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"vLLM not ready after {VLLM_READY_S} s:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.mark.timeout(VLLM_READY_S + 120)
def test_real_vllm_and_the_simulator_tokenize_alike(
    sim_factory: Factory, tiny_llama_dir: Path, real_vllm: str, tmp_path: Path
) -> None:
    argv = resolve_engine("vllm", real_vllm, python=sys.executable)[2]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "vllm.log"
    flags = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--enforce-eager",
             "--block-size", str(CPU_BLOCK_SIZE), *cpu_server_args()]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen([*argv, "serve", str(tiny_llama_dir), *flags], env=child_env(cpu_server_env(tmp_path)),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        sim: SimServer = sim_factory("--max-model-len", "512", model=str(tiny_llama_dir))
        _wait_healthy(proc, url, log)
        sim.wait_ready()
        for prompt in PROMPTS:
            for body in ({"prompt": prompt}, {"prompt": prompt, "add_special_tokens": False}):
                real = httpx.post(url + "/tokenize", json=body, timeout=30.0).json()
                print(f"vLLM /tokenize {body}: count {real['count']}")  # the counts, for the record (-s)
                assert sim.post("/tokenize", body).json() == real, body
            ids = {"tokens": real["tokens"]}
            assert sim.post("/detokenize", ids).json() == httpx.post(url + "/detokenize", json=ids, timeout=30.0).json()
            request = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            real_usage = httpx.post(url + "/v1/completions", json=request, timeout=60.0).json()["usage"]
            assert sim.complete(prompt, max_tokens=1).json()["usage"]["prompt_tokens"] == real_usage["prompt_tokens"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
