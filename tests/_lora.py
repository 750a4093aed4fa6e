"""A do-nothing LoRA adapter (PEFT layout, zero B matrices) for a local model: what a runtime-LoRA test loads.

Stdlib only (the safetensors layout is written by hand), so an inner pytest session can import it from its own
directory. Real vLLM loads it for the tiny Llama (``--enable-lora``, checked on vLLM for CPU 0.32); the
simulator only needs the directory to exist, as vLLM's ``LoRAAdapterNotFoundError`` rule does.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

RANK = 4


def write_zero_adapter(model: str, out: Path) -> Path:
    """Write an adapter for ``model``'s q_proj and v_proj into ``out`` and return it.

    A model without a local ``config.json`` (the simulator's named shapes) gets the config file alone.
    """
    out.mkdir(parents=True, exist_ok=True)
    config_path = Path(model) / "config.json"
    modules = ("q_proj", "v_proj")
    config = {
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(modules), "bias": "none",
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "base_model_name_or_path": model,
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    if not config_path.is_file():
        return out
    cfg = json.loads(config_path.read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out_dims = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            shapes[f"{prefix}.lora_A.weight"] = (RANK, hidden)
            shapes[f"{prefix}.lora_B.weight"] = (out_dims[name], RANK)
    header: dict[str, object] = {}
    offset = 0
    for key, (rows, cols) in shapes.items():
        size = rows * cols * 4  # F32
        header[key] = {"dtype": "F32", "shape": [rows, cols], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the safetensors header is padded to 8 bytes
    (out / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return out
