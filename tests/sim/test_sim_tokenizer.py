"""A checkpoint directory's tokenizer.json is the simulator's tokenizer (issue 26): /tokenize, /detokenize, usage,
the context-length rule and the prefix cache count the checkpoint's tokens, BOS as its post-processor adds it.

The checkpoint is the tiny Llama real vLLM serves (the `tiny_llama_dir` fixture builds it with the vLLM venv's
python, so these tests are in the `vllm` tier even where only the simulator runs); the last test asks one real
vLLM server on it for the same answers. The refusal without the `tokenizers` package needs no checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from pytest_pdserve.sim import tokenizer

from ._simproc import Factory, SimServer

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


def test_real_vllm_and_the_simulator_tokenize_alike(
    sim_factory: Factory, tiny_llama_dir: Path, real_pd_cluster: Any
) -> None:
    """The real side is the prefill server of the real-vLLM tier's shared cluster (tests/conftest.py: the tiny Llama,
    max_model_len 512, eager, the CPU flags): a `vllm serve` start of its own cost this test 206 s at load 12."""
    real_server = real_pd_cluster.prefill[0]
    assert Path(real_pd_cluster.model) == tiny_llama_dir
    assert real_pd_cluster.spec.max_model_len == 512
    url = real_server.url
    sim: SimServer = sim_factory("--max-model-len", "512", model=str(tiny_llama_dir))
    sim.wait_ready()
    for prompt in PROMPTS:
        for body in ({"prompt": prompt}, {"prompt": prompt, "add_special_tokens": False}):
            real = httpx.post(url + "/tokenize", json=body, timeout=30.0).json()
            print(f"vLLM /tokenize {body}: count {real['count']}")  # the counts, for the record (-s)
            assert sim.post("/tokenize", body).json() == real, body
        ids = {"tokens": real["tokens"]}
        assert sim.post("/detokenize", ids).json() == httpx.post(url + "/detokenize", json=ids, timeout=30.0).json()
        request = {"model": real_pd_cluster.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        real_usage = httpx.post(url + "/v1/completions", json=request, timeout=60.0).json()["usage"]
        assert sim.complete(prompt, max_tokens=1).json()["usage"]["prompt_tokens"] == real_usage["prompt_tokens"]


def _checkpoint(tmp_path: Path, files: dict[str, str]) -> Path:
    """A checkpoint directory with the tiny Llama's shape and ``files`` (no tokenizer.json: built-in tokens)."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
              "torch_dtype": "float32", "max_position_embeddings": 2048, "vocab_size": 2048}  # fmt: skip
    (checkpoint / "config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (checkpoint / name).write_text(text)
    return checkpoint


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Red Hat is"}]


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_chat_prompts_are_rendered_with_the_checkpoints_template(
    sim_factory: Factory, tmp_path: Path, where: str
) -> None:
    """vLLM renders a chat request with the checkpoint's template, so its prompt_tokens are that text's tokens; a
    simulator that used its own template counted other tokens (green on the simulator, red on vLLM)."""
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    files = (
        {"chat_template.jinja": template, "tokenizer_config.json": json.dumps({"bos_token": "<s>"})}
        if where == "chat_template.jinja"
        else {"tokenizer_config.json": json.dumps({"bos_token": "<s>", "chat_template": template})}
    )
    server: SimServer = sim_factory("--max-model-len", "512", model=str(_checkpoint(tmp_path, files))).wait_ready()
    text = "<s><|system|>\nBe brief.\n<|user|>\nRed Hat is\n<|assistant|>\n"
    usage = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(text, add_bos=False))
    assert usage["prompt_tokens"] != len(tokenizer.encode(tokenizer.builtin_chat_text(CHAT), add_bos=False))


def test_a_chat_template_without_jinja2_is_refused_at_start(sim_factory: Factory, tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, {"chat_template.jinja": "{{ messages[0]['content'] }}"})
    hidden = tmp_path / "no-jinja2" / "jinja2"  # shadows the installed package: its import fails
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'jinja2'\")\n")
    server: SimServer = sim_factory(model=str(checkpoint), env={"PYTHONPATH": str(hidden.parent)})
    assert server.wait_exit() == 1
    assert f"its chat template {checkpoint / 'chat_template.jinja'} needs the optional 'jinja2' package" in server.log()


def test_completion_top_logprobs_have_as_many_entries_as_asked(sim_factory: Factory, tiny_llama_dir: Path) -> None:
    """Completion ``top_logprobs`` entries are keyed by token text, and byte-level pieces of one character all
    decode to U+FFFD: two such alternatives would make one entry. vLLM rewrites them from the context and gave
    ``logprobs`` entries at every position in every differential run (tests/sim/test_differential.py's
    ``logprobs.shape``); the simulator keeps alternatives whose text is new."""
    server: SimServer = sim_factory("--max-model-len", "512", model=str(tiny_llama_dir)).wait_ready()
    counts = []
    for seed in range(40):
        body = server.complete("Hello world", max_tokens=16, logprobs=5, seed=seed, temperature=1.0).json()
        counts += [len(top) for top in body["choices"][0]["logprobs"]["top_logprobs"]]
    assert len(counts) == 40 * 16
    assert set(counts) == {5}, sorted(set(counts))
