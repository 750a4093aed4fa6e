"""The served model's shape, KV sizes, eviction and token counts (issue 16)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from pytest_pdserve.sim import model, tokenizer
from pytest_pdserve.sim.app import AppState, build_app
from pytest_pdserve.sim.cli import parse_serve_args
from pytest_pdserve.sim.engine import Engine
from pytest_pdserve.sim.faults import SimEnv

# vLLM's own test prompt (tests/v1/kv_connector/nixl_integration/test_multi_connector_edge_cases.py); at least
# 132 Qwen3 tokens, so at least one full 128-token block: the built-in tokenizer must agree.
PARTIAL_CACHE_PREFIX = (
    "Machine learning has transformed the field of artificial intelligence "
    "by enabling computers to learn patterns from data without being "
    "explicitly programmed for every task. The field has evolved dramatically "
    "since its inception in the 1950s when Arthur Samuel coined the term while "
    "working at IBM. Early approaches focused on symbolic reasoning and expert "
    "systems that encoded human knowledge as rules. The statistical revolution "
    "of the 1990s shifted the paradigm toward data driven methods. Support "
    "vector machines and random forests became popular for classification tasks. "
    "The breakthrough of deep learning in 2012 with AlexNet winning ImageNet "
    "changed everything. Neural networks with many layers could automatically "
    "learn hierarchical feature representations from raw data."
)


def engine(*flags: str) -> Engine:
    return Engine(parse_serve_args(list(flags)), SimEnv(), "CPU_ATTN")


def test_builtin_tokenizer_splits_digits_like_qwen_and_llama() -> None:
    assert tokenizer._PIECE.findall(" in 1950s") == [" in", " ", "1", "9", "5", "0", "s"]
    assert len(tokenizer.encode(PARTIAL_CACHE_PREFIX)) >= 132  # 119 when numbers were one token


@pytest.mark.parametrize(
    ("flags", "per_token"),
    [
        (["Qwen/Qwen3-0.6B"], 114_688),  # 28 layers x K,V x 8 heads x 128 x bf16
        (["pdserve-sim/tiny-llama"], 512),  # float32 checkpoint served as bfloat16 under --dtype auto
        (["pdserve-sim/tiny-llama", "--dtype", "float32"], 1024),  # vllm-cpu.md: 131072 B per 128-token block
        (["pdserve-sim/tiny-llama", "--kv-cache-dtype", "fp8"], 256),
        (["pdserve-sim/tiny-nemotronh", "--dtype", "float32"], 512),  # one attention layer of four
    ],
)
def test_kv_bytes_per_token_follow_the_model_shape(flags: list[str], per_token: int) -> None:
    assert engine(*flags).bytes_per_token == per_token


def test_block_count_from_kv_cache_memory_bytes_and_utilization() -> None:
    qwen = engine("Qwen/Qwen3-0.6B", "--block-size", "128", "--kv-cache-memory-bytes", "268435456")
    assert qwen.pool.num_blocks == 18  # 2,340 tokens of 114,688 B: 18 whole 128-token blocks
    assert qwen.max_model_len == 40960
    default = engine("pdserve-sim/tiny-llama", "--block-size", "128").pool.num_blocks
    half = engine("pdserve-sim/tiny-llama", "--block-size", "128", "--gpu-memory-utilization", "0.45").pool.num_blocks
    assert half == default // 2


def test_local_model_directory_config_is_read(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_size": 512,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    e = engine(str(tmp_path))
    assert e.bytes_per_token == 4 * 2 * 4 * 64 * 2
    assert e.max_model_len == 4096
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(model.ModelConfigError, match="num_hidden_layers"):
        engine(str(tmp_path))


def test_eviction_is_lru_of_free_blocks_and_not_vacuous() -> None:
    """Qwen3-0.6B in 256 MiB holds 18 blocks: a prompt's cached blocks are evicted by later traffic."""
    e = engine("Qwen/Qwen3-0.6B", "--block-size", "128", "--kv-cache-memory-bytes", "268435456")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(AppState(engine=e))), base_url="http://s")

    async def hit_of(prompt: list[int]) -> int:
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return int(e.metrics.prefix_cache_hits.labels(**e.metrics.labels)._value.get())

    async def scenario() -> None:
        first = [7] * 300  # 2 full blocks + a partial one
        await hit_of(first)
        assert await hit_of(first) == 256  # warm: both full blocks hit
        for i in range(8):  # 8 x 3 blocks of other prompts > 18 blocks: the first prompt is evicted
            await hit_of([100 + i] * 300)
        before = await hit_of([5])
        assert await hit_of(first) == before  # no hit any more
        assert e.pool.evictions > 0

    asyncio.run(scenario())


@pytest.mark.skipif(not tokenizer.tokenizers_available(), reason="the optional 'tokenizers' package is not installed")
def test_real_tokenizer_of_a_model_directory(tmp_path: Path, tiny_llama_dir: Path) -> None:
    import tokenizers

    source = tiny_llama_dir
    e = engine(str(source))
    real = tokenizers.Tokenizer.from_file(str(source / "tokenizer.json"))
    text = "Red Hat is the best company in the world, since 1993."
    assert e.tok.encode(text) == real.encode(text).ids
    assert e.tok.encode(text) != tokenizer.encode(text)
    loaded = tokenizer.load(str(source), None)
    assert loaded.encode(text) == real.encode(text).ids
    with pytest.raises(tokenizer.TokenizerError, match="no tokenizer.json"):
        tokenizer.load(str(tmp_path), None)


def test_the_hybrid_checkpoint_as_transformers_5_writes_it_loads(tmp_path: Path) -> None:
    """Issue 26: tiny_model.py's NemotronH under transformers 5.19 has layers_block_type and num_hidden_layers
    null (tests/data/tiny-models/nemotronh-config.json, copied from the built checkpoint); it failed to load."""
    recorded = Path(__file__).parent.parent / "data" / "tiny-models" / "nemotronh-config.json"
    (tmp_path / "config.json").write_text(recorded.read_text())
    shape = model.resolve(str(tmp_path))
    assert (shape.num_attention_layers, shape.num_mamba_layers, shape.mamba) == (1, 1, model.TINY_NEMOTRONH.mamba)
    assert shape.kv_bytes_per_token("auto", "auto") == model.TINY_NEMOTRONH.kv_bytes_per_token("auto", "auto")
    # the built-in shape is the recipe's (heads of 64 since issue 44)
    assert (shape.num_kv_heads, shape.head_dim) == (model.TINY_NEMOTRONH.num_kv_heads, model.TINY_NEMOTRONH.head_dim)
    bad = {**json.loads(recorded.read_text()), "layers_block_type": ["linear_attention", "sparkle"]}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(model.ModelConfigError, match=r"layers_block_type has unknown layer types \['sparkle'\]"):
        model.resolve(str(tmp_path))
