"""Deterministic synthetic tokenizer and "model" of the simulator (stdlib only).

Text is split into regex pieces (a word or a punctuation mark with its leading whitespace); each piece
maps to a stable id in a 2048-token vocabulary through blake2b, so every process, on every machine,
tokenizes the same text to the same ids. Like the tiny Llama tokenizer the reference uses, ids 0..3
are ``<s> </s> <unk> <pad>`` and text prompts get a leading BOS; token-id prompts are used as given.

Generated ids are detokenized through a fixed synthetic word list. At temperature 0 the generated ids
are a pure function of the model name ("the weights") and the prompt ids (a hash chain), never of
``--seed``, just as greedy decoding in vLLM does not depend on the seed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
from array import array
from collections.abc import Sequence
from pathlib import Path

VOCAB_SIZE = 2048
BOS_ID = 0
EOS_ID = 1
UNK_ID = 2
PAD_ID = 3
FIRST_REGULAR_ID = 4
SPECIAL_TOKENS = {BOS_ID: "<s>", EOS_ID: "</s>", UNK_ID: "<unk>", PAD_ID: "<pad>"}

# Words with their leading whitespace; every digit alone and the whitespace before a number apart, as the
# Llama 3 / Qwen pre-tokenizers split them (" 1950s" -> " ", "1", "9", "5", "0", "s"); punctuation; whitespace.
_PIECE = re.compile(r"\s*[^\W\d_]+|\d|\s*[^\w\s]|\s*_|\s+")
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "ta",
    "so",
    "vi",
    "de",
    "pa",
    "zu",
    "ho",
    "ri",
    "ge",
    "bo",
    "an",
    "el",
    "is",
    "on",
    "ur",
)


class ChatTemplate:
    """A checkpoint's chat template (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``),
    rendered as transformers renders it for vLLM: a sandboxed Jinja2 environment with ``trim_blocks`` and
    ``lstrip_blocks``, ``raise_exception`` and the tokenizer config's special-token strings in scope.

    :raises ImportError: the optional ``jinja2`` package is not installed.
    """

    def __init__(self, source: str, origin: str, special: dict[str, str]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # optional: only checkpoints with a template

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self._special = special
        self.origin = origin

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for ``messages``, with the generation prompt (what vLLM's chat route asks for)."""
        return str(self._template.render(messages=messages, add_generation_prompt=True, **self._special))


def builtin_chat_text(messages: list[dict[str, str]]) -> str:
    """The template of the project's tiny models (``tiny_model.py`` writes it), for names without a checkpoint."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class Tokenizer:
    """The built-in synthetic tokenizer (the functions of this module behind one interface)."""

    name = "built-in"
    #: The checkpoint's chat template; None: the built-in one (:func:`builtin_chat_text`).
    chat_template: ChatTemplate | None = None

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        """The chat prompt's text, through the checkpoint's template when it has one, as vLLM renders it."""
        if self.chat_template is not None:
            return self.chat_template.render(messages)
        return builtin_chat_text(messages)

    vocab_size = VOCAB_SIZE
    special_ids: frozenset[int] = frozenset(SPECIAL_TOKENS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (a leading BOS when ``add_special_tokens``)."""
        return encode(text, add_bos=add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ids, special tokens skipped."""
        return decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """Text of one generated id ("" for a special token)."""
        return "" if token_id in self.special_ids else token_text(token_id)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ids with special tokens kept, as vLLM's /detokenize answers (HF ``decode``'s default)."""
        return "".join(token_text(t) for t in token_ids)


class FileTokenizer(Tokenizer):
    """A checkpoint's ``tokenizer.json``, through the optional ``tokenizers`` package (what vLLM uses).

    :raises ImportError: ``tokenizers`` is not installed.
    """

    def __init__(self, path: Path) -> None:
        import tokenizers  # type: ignore[import-not-found,unused-ignore]  # optional: pip install tokenizers

        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.name = str(path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.special_ids = frozenset(
            int(i) for i, added in self._tok.get_added_tokens_decoder().items() if added.special
        )
        self._texts: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = "" if token_id in self.special_ids else self.decode([token_id])
        return text


def tokenizers_available() -> bool:
    """Whether the optional ``tokenizers`` package can be imported."""
    return importlib.util.find_spec("tokenizers") is not None


class TokenizerError(ValueError):
    """``--tokenizer`` or MODEL's ``tokenizer.json`` is something the simulator cannot load."""


def _from_file(file: Path, given: str) -> FileTokenizer:
    """:raises TokenizerError: ``tokenizers`` is not importable, or ``file`` is not a tokenizer it can read."""
    try:
        return FileTokenizer(file)
    except ImportError:
        raise TokenizerError(
            f"{given}: {file} needs the optional 'tokenizers' package (pip install tokenizers): the simulator "
            "counts tokens with the checkpoint's own tokenizer, as vLLM does"
        ) from None
    except Exception as exc:  # tokenizers raises its own Exception subclass for bad files
        raise TokenizerError(f"{given}: cannot load {file}: {exc}") from None


def _chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template a checkpoint directory carries, or None.

    :raises TokenizerError: there is one and ``jinja2`` is not installed (vLLM would render it: the built-in
        template's token counts would differ), or it does not parse.
    """
    config: dict[str, object] = {}
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"model {directory}: cannot read {config_file}: {exc}") from None
        config = loaded if isinstance(loaded, dict) else {}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        source, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    elif isinstance(config.get("chat_template"), str):
        source, origin = str(config["chat_template"]), f"{config_file} (chat_template)"
    else:
        return None
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    try:
        return ChatTemplate(source, origin, special)
    except ImportError:
        raise TokenizerError(
            f"model {directory}: its chat template {origin} needs the optional 'jinja2' package (pip install "
            "jinja2): the simulator renders chat prompts with the checkpoint's own template, as vLLM does"
        ) from None
    except Exception as exc:  # jinja2's TemplateSyntaxError
        raise TokenizerError(f"model {directory}: cannot parse its chat template {origin}: {exc}") from None


def load(explicit: str | None, model_dir: Path | None) -> Tokenizer:
    """The tokenizer to serve with, and its chat template (:func:`_chat_template`, from the same directory)."""
    tok = _load_tokens(explicit, model_dir)
    directory = Path(explicit).expanduser() if explicit is not None else model_dir
    if directory is not None and directory.is_dir():
        tok.chat_template = _chat_template(directory)
    return tok


def _load_tokens(explicit: str | None, model_dir: Path | None) -> Tokenizer:
    """The tokenizer to serve with.

    ``--tokenizer DIR`` (or a file) is used, or MODEL's directory when it holds a ``tokenizer.json``; both need
    the optional ``tokenizers`` package, and without it the server refuses to start (issue 26: the built-in
    tokenizer's counts differ from the checkpoint's, 7,211 against 17,832 tokens for vLLM's mamba prompt, so a
    suite green on the simulator went red on vLLM). Its post-processor adds BOS as vLLM's /tokenize does with
    ``add_special_tokens`` true. Built-in names and other names keep the built-in tokenizer.

    :raises TokenizerError: ``--tokenizer`` is missing, a tokenizer file is unreadable, or ``tokenizers`` is not
        installed.
    """
    if explicit is not None:
        path = Path(explicit).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"--tokenizer {explicit}: no tokenizer.json there")
        return _from_file(file, f"--tokenizer {explicit}")
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return _from_file(model_dir / "tokenizer.json", f"model {model_dir}")
    return Tokenizer()


def ids_bytes(ids: Sequence[int]) -> bytes:
    """Packed little-endian uint32 form of token ids, the input of every hash in the simulator."""
    return array("I", ids).tobytes()


def _piece_id(piece: str) -> int:
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return FIRST_REGULAR_ID + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_REGULAR_ID)


def encode(text: str, add_bos: bool = True) -> list[int]:
    """Token ids of ``text`` (with a leading BOS unless ``add_bos`` is false)."""
    ids = [BOS_ID] if add_bos else []
    ids.extend(_piece_id(piece) for piece in _PIECE.findall(text))
    return ids


def token_text(token_id: int) -> str:
    """Text of one generated id: a synthetic word with a leading space, or a special token."""
    if token_id in SPECIAL_TOKENS:
        return SPECIAL_TOKENS[token_id]
    i = token_id - FIRST_REGULAR_ID
    word = _SYLLABLES[i % 20] + _SYLLABLES[(i // 20) % 20]
    if i >= 400:
        word += _SYLLABLES[(i // 400) % 20]
    return " " + word


def decode(token_ids: Sequence[int]) -> str:
    """Text of generated ids (special tokens skipped, like ``skip_special_tokens=True``)."""
    return "".join(token_text(t) for t in token_ids if t not in SPECIAL_TOKENS)


def _token_from(digest: bytes) -> int:
    return FIRST_REGULAR_ID + int.from_bytes(digest[:8], "little") % (VOCAB_SIZE - FIRST_REGULAR_ID)


def generate_ids(model_key: bytes, prompt_ids: Sequence[int], count: int, sample_key: bytes = b"") -> list[int]:
    """``count`` generated ids: a blake2b chain seeded by ``model_key`` (the engine passes the request's context:
    ``kvcontent.context_digest``, the weights and the KV it computed with), the prompt and ``sample_key``.

    ``sample_key`` is empty for greedy decoding (temperature 0); for sampling it carries the request
    seed and temperature so that a seeded request is reproducible and different seeds differ.
    """
    state = hashlib.blake2b(model_key + b"|" + sample_key + b"|" + ids_bytes(prompt_ids), digest_size=16).digest()
    out: list[int] = []
    for step in range(count):
        state = hashlib.blake2b(state + step.to_bytes(4, "little"), digest_size=16).digest()
        out.append(_token_from(state))
    return out


def perturb(token_id: int, salt: bytes) -> int:
    """A different regular id derived from ``token_id`` (for the simulated batch-variance)."""
    digest = hashlib.blake2b(salt + token_id.to_bytes(4, "little"), digest_size=8).digest()
    offset = 1 + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_REGULAR_ID - 1)
    return FIRST_REGULAR_ID + (token_id - FIRST_REGULAR_ID + offset) % (VOCAB_SIZE - FIRST_REGULAR_ID)


TOP_RANKS = 20
"""Ranks :func:`top_logprobs` computes (vLLM's default ``--max-logprobs``): the values do not depend on how many
a request asks for."""
MIN_GAP = 0.06
"""Nats: the smallest gap between neighbouring ranks, so the simulator has no near-ties of its own (under the
assertions' 0.05 tie tolerance); ``PDSERVE_SIM_TIE_FLIP`` makes one on purpose."""


def top_logprobs(context: bytes, position: int, token_id: int, tie_gap: float | None = None) -> list[float]:
    """The logprobs of ranks 0..19 at an output position: a normalized distribution drawn from ``context`` (the
    request's ``kvcontent.context_digest``), so they move when the context does.

    Neighbouring ranks are ``MIN_GAP`` plus an exponential draw (mean 0.7 nats) apart, the first gap ``tie_gap``
    when given; the tokens beyond rank 19 share a tail mass. Confident like the tiny models of ``tiny_model.py``:
    the top-1 probability is typically 0.6-0.9.
    """
    raw = hashlib.shake_256(b"lp|" + context + position.to_bytes(4, "little") + token_id.to_bytes(4, "little")).digest(
        4 * (TOP_RANKS + 1)
    )
    u = [(int.from_bytes(raw[4 * i : 4 * i + 4], "little") + 0.5) / 2**32 for i in range(TOP_RANKS + 1)]
    logits = [0.0]
    for rank in range(1, TOP_RANKS):
        gap = tie_gap if rank == 1 and tie_gap is not None else MIN_GAP - 0.7 * math.log(u[rank])
        logits.append(logits[-1] - gap)
    tail = -1.0 + 1.5 * math.log(u[TOP_RANKS])  # the log-mass of every other token together
    norm = math.log(sum(math.exp(x) for x in logits) + math.exp(tail))
    return [x - norm for x in logits]


def top_alternatives(token_id: int, position: int, n: int, salt: bytes = b"") -> list[int]:
    """``n`` distinct ids, the first being ``token_id`` (the sampled token ranks first at temperature 0); ``salt``
    (the request's context) makes another context rank other alternatives.

    Bounded by construction: at most ``2 * n`` hash draws, then a linear fill. (Iterating ``perturb`` on
    its own output, as an earlier version did, can enter a cycle shorter than ``n`` and never return:
    issue 16, logprobs 3 and 5 hung on some prompts.)
    """
    span = VOCAB_SIZE - FIRST_REGULAR_ID
    n = min(n, span)
    out = [token_id]
    seen = {token_id}
    salt = salt + position.to_bytes(4, "little")
    for draw in range(2 * n):
        if len(out) >= n:
            return out
        candidate = perturb(token_id, salt + draw.to_bytes(4, "little"))
        if candidate not in seen:
            seen.add(candidate)
            out.append(candidate)
    candidate = token_id
    for _ in range(span):  # the rare draw collisions: next free ids after token_id
        if len(out) >= n:
            break
        candidate = FIRST_REGULAR_ID + (candidate - FIRST_REGULAR_ID + 1) % span
        if candidate not in seen:
            seen.add(candidate)
            out.append(candidate)
    return out
