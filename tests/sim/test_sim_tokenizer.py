"""A checkpoint directory's tokenizer.json is the simulator's tokenizer (issue 26): /tokenize, /detokenize, usage,
the context-length rule and the prefix cache count the checkpoint's tokens, BOS as its post-processor adds it.

The checkpoint is the tiny Llama real vLLM serves (the `tiny_llama_dir` fixture builds it with the vLLM venv's
python, so these tests are in the `vllm` tier, although only the simulator runs); tests/test_tokenizer_parity.py
asks real vLLM for the same counts. The refusal without the `tokenizers` package needs no checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

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
def real(tiny_llama_dir: Path) -> object:
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


def test_the_simulator_counts_with_the_checkpoints_tokenizer(
    sim_factory: Factory, tiny_llama_dir: Path, real: object
) -> None:
    encode = real.encode  # type: ignore[attr-defined]
    server: SimServer = sim_factory("--max-model-len", "512", "--enable-prompt-tokens-details",
                                    model=str(tiny_llama_dir)).wait_ready()  # fmt: skip
    bos = real.token_to_id("<s>")  # type: ignore[attr-defined]
    for prompt in PROMPTS:
        ids = encode(prompt).ids
        assert ids[0] == bos and ids != tokenizer.encode(prompt)  # the post-processor's BOS; not the built-in's
        body = server.post("/tokenize", {"prompt": prompt}).json()
        assert (body["count"], body["tokens"]) == (len(ids), ids), prompt
        plain = server.post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
        assert plain["tokens"] == encode(prompt, add_special_tokens=False).ids == ids[1:]
        text = real.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        assert text.startswith("<s>") and server.post("/detokenize", {"tokens": ids}).json()["prompt"] == text
        usage = server.complete(prompt, max_tokens=1).json()["usage"]
        assert usage["prompt_tokens"] == len(ids)

    # The context-length rule and the prefix cache count the checkpoint's tokens: this prompt is over 512 tokens
    # for the tiny Llama and well under it for the built-in tokenizer.
    long = PROMPTS[1] + " " + " ".join([PROMPTS[1]] * 14)
    n = len(encode(long).ids)
    assert len(tokenizer.encode(long)) < 512 < n
    refused = server.complete(long, max_tokens=1)
    assert refused.status_code == 400 and "maximum context length is 512 tokens" in refused.text, refused.text
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
