"""The shape of the simulated model: what sizes the KV cache, the Mamba state and the tokenizer.

Where the shape comes from, in order:

1. MODEL is a local directory with a ``config.json`` (a Hugging Face checkpoint, e.g. the tiny models that
   ``tiny_model.py`` builds): its layers, KV heads, head size, dtype, context length and vocabulary are read,
   and its ``tokenizer.json`` is the tokenizer (see :mod:`pytest_pdserve.sim.tokenizer`);
2. a known name (:data:`KNOWN_MODELS`, shapes copied from the models' ``config.json``);
3. anything else: the tiny Llama's shape, with a log line saying so.

KV bytes per token are vLLM's: ``attention layers x 2 (K and V) x KV heads x head size x element size``
(Qwen/Qwen3-0.6B in bfloat16: 28 x 2 x 8 x 128 x 2 = 114,688). The element size follows ``--dtype`` and
``--kv-cache-dtype`` as in vLLM: ``auto`` is the checkpoint's dtype, except that float32 checkpoints are
served in bfloat16 (vLLM's ``_resolve_auto_dtype`` downcasts them; ``--dtype float32`` keeps float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ELEMENT_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class ModelConfigError(ValueError):
    """A local model directory whose ``config.json`` cannot be read as a decoder model."""


@dataclass(frozen=True)
class MambaShape:
    """Per-layer Mamba2 state of one request (vLLM's ``MambaStateShapeCalculator.mamba2_state_shape``)."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    head_dim: int
    state_size: int

    @property
    def elements(self) -> int:
        """Conv state ``conv_dim x (kernel - 1)`` plus SSM state ``heads x head_dim x state_size``."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.head_dim * self.state_size


@dataclass(frozen=True)
class ModelShape:
    """What the simulator needs to know about a model."""

    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_position_embeddings: int
    vocab_size: int
    num_mamba_layers: int = 0
    mamba: MambaShape | None = None
    directory: Path | None = None
    source: str = "built-in"

    @property
    def is_hybrid(self) -> bool:
        """Attention plus Mamba layers (vLLM's hybrid KV cache manager)."""
        return self.num_mamba_layers > 0

    def serving_dtype(self, dtype_flag: str) -> str:
        """The dtype vLLM runs with for ``--dtype dtype_flag`` (float32 checkpoints: bfloat16 under ``auto``)."""
        if dtype_flag != "auto":
            return {"float": "float32", "half": "float16"}.get(dtype_flag, dtype_flag)
        return "bfloat16" if self.dtype == "float32" else self.dtype

    def kv_bytes_per_token(self, dtype_flag: str, kv_cache_dtype: str) -> int:
        """KV bytes one token takes in the attention layers."""
        if kv_cache_dtype.startswith("fp8"):
            elem = 1
        elif kv_cache_dtype in ELEMENT_BYTES:
            elem = ELEMENT_BYTES[kv_cache_dtype]
        else:
            elem = ELEMENT_BYTES[self.serving_dtype(dtype_flag)]
        return self.num_attention_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def mamba_state_bytes(self, dtype_flag: str) -> int:
        """Mamba state bytes of one request, all Mamba layers (0 for a pure attention model).

        The conv state is kept in the serving dtype; the SSM state in float32 (NemotronH's
        ``DEFAULT_MAMBA_SSM_CACHE_DTYPE``, vLLM's ``mamba_ssm_cache_dtype`` default for it).
        """
        if self.mamba is None:
            return 0
        m = self.mamba
        conv = m.conv_dim * (m.conv_kernel - 1) * ELEMENT_BYTES[self.serving_dtype(dtype_flag)]
        ssm = m.num_heads * m.head_dim * m.state_size * 4
        return self.num_mamba_layers * (conv + ssm)


TINY_LLAMA = ModelShape(2, 1, 64, "float32", 2048, 2048, source="pdserve-sim/tiny-llama")
"""``tiny_model.py``'s Llama: 2 layers, 1 KV head of 64, float32, vocabulary 2048."""

TINY_NEMOTRONH = ModelShape(
    1,
    1,
    64,
    "float32",
    2048,
    2048,
    num_mamba_layers=1,
    # hybrid_override_pattern "M-*-": one Mamba2 layer (8 heads x 32 + 2 x 1 group x 16 = conv dim 288),
    # one attention layer (1 KV head of 64); 8 Mamba heads of 32, state size 16, conv kernel 4.
    mamba=MambaShape(conv_dim=288, conv_kernel=4, num_heads=8, head_dim=32, state_size=16),
    source="pdserve-sim/tiny-nemotronh",
)

KNOWN_MODELS: dict[str, ModelShape] = {
    "pdserve-sim/tiny-llama": TINY_LLAMA,
    "pdserve-sim/tiny-nemotronh": TINY_NEMOTRONH,
    # Shapes from each model's config.json on the Hugging Face Hub.
    "Qwen/Qwen3-0.6B": ModelShape(28, 8, 128, "bfloat16", 40960, 151936, source="Qwen/Qwen3-0.6B"),
    "Qwen/Qwen3-1.7B": ModelShape(28, 8, 128, "bfloat16", 40960, 151936, source="Qwen/Qwen3-1.7B"),
    "Qwen/Qwen3-8B": ModelShape(36, 8, 128, "bfloat16", 40960, 151936, source="Qwen/Qwen3-8B"),
    "meta-llama/Llama-3.1-8B-Instruct": ModelShape(
        32, 8, 128, "bfloat16", 131072, 128256, source="meta-llama/Llama-3.1-8B-Instruct"
    ),
}


def _int(config: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelConfigError(f"{where}: {key}={value!r} is not a non-negative integer")
    return value


def from_config(directory: Path) -> ModelShape:
    """Read a checkpoint's ``config.json``. :raises ModelConfigError: missing or unusable fields."""
    where = directory / "config.json"
    try:
        config = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{where}: cannot read it as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{where}: not a JSON object")
    config = {**config.get("text_config", {}), **config} if isinstance(config.get("text_config"), dict) else config
    pattern = config.get("hybrid_override_pattern")
    block_types = config.get("layers_block_type")
    if isinstance(block_types, list):
        # transformers >= 5 writes NemotronH's layers as a list and num_hidden_layers as null (derived from it);
        # the mapping is its NemotronHConfig._pattern_to_list, read backwards.
        letters = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                   "moe": "E"}  # fmt: skip
        unknown = sorted({str(t) for t in block_types if t not in letters})
        if unknown:
            raise ModelConfigError(f"{where}: layers_block_type has unknown layer types {unknown}")
        pattern = "".join(letters[t] for t in block_types)
        if config.get("num_hidden_layers") is None:
            config = {**config, "num_hidden_layers": len(block_types)}
    layers = _int(config, "num_hidden_layers", where)
    heads = _int(config, "num_attention_heads", where)
    kv_heads = _int(config, "num_key_value_heads", where, heads)
    head_dim = config.get("head_dim") or _int(config, "hidden_size", where) // max(heads, 1)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in ELEMENT_BYTES:
        raise ModelConfigError(f"{where}: dtype {dtype!r} is not one of {sorted(ELEMENT_BYTES)}")
    shape = ModelShape(
        num_attention_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        dtype=dtype,
        max_position_embeddings=_int(config, "max_position_embeddings", where, 2048),
        vocab_size=_int(config, "vocab_size", where),
        directory=directory,
        source=str(where),
    )
    if isinstance(pattern, str) and "M" in pattern:
        groups = _int(config, "n_groups", where, 1)
        state = _int(config, "ssm_state_size", where)
        num_heads = _int(config, "mamba_num_heads", where)
        mamba_head_dim = _int(config, "mamba_head_dim", where)
        mamba = MambaShape(
            conv_dim=num_heads * mamba_head_dim + 2 * groups * state,
            conv_kernel=_int(config, "conv_kernel", where, 4),
            num_heads=num_heads,
            head_dim=mamba_head_dim,
            state_size=state,
        )
        shape = replace(
            shape, num_attention_layers=pattern.count("*"), num_mamba_layers=pattern.count("M"), mamba=mamba
        )
    return shape


def resolve(model: str) -> ModelShape:
    """The shape of MODEL: a local checkpoint directory, a known name, or the tiny Llama's shape."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return from_config(path)
    if model in KNOWN_MODELS:
        return KNOWN_MODELS[model]
    return replace(TINY_LLAMA, source=f"default (tiny Llama shape; {model!r} is not a known name or local directory)")
