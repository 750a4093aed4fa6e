"""VLLM_SERVE_EXTRA_ARGS parsing: vLLM's comma form and the shell form."""

from __future__ import annotations

import pytest

from pytest_pdserve.config.extra_args import is_comma_form, parse_extra_args
from pytest_pdserve.errors import ExtraArgsError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # vLLM's run_accuracy_test.sh example
        ("--max-model-len,8192,--trust-remote-code", ("--max-model-len", "8192", "--trust-remote-code")),
        # the DSv4 nightly step
        ("--trust-remote-code,--kv-cache-dtype,fp8", ("--trust-remote-code", "--kv-cache-dtype", "fp8")),
        # the Kimi nightly step writes a flag and its value in one comma piece
        ("--trust-remote-code,--max-model-len 32768", ("--trust-remote-code", "--max-model-len", "32768")),
        # whitespace around pieces and empty pieces are dropped
        (" --a , 1 ,, --b ,", ("--a", "1", "--b")),
        ("--foo,a b", ("--foo", "a b")),
        ("--foo=x,--bar", ("--foo=x", "--bar")),
    ],
)
def test_comma_form(value: str, expected: tuple[str, ...]) -> None:
    assert is_comma_form(value)
    assert parse_extra_args(value) == expected


def test_hostile_value_stays_one_argv_element() -> None:
    assert parse_extra_args("--served-model-name,x; rm -rf /") == ("--served-model-name", "x; rm -rf /")


def test_flag_piece_with_value_keeps_the_rest_whole() -> None:
    # Only the first whitespace run separates flag and value.
    assert parse_extra_args("--a,--chat-template  x y") == ("--a", "--chat-template", "x y")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("--max-model-len 8192 --foo 'a b'", ("--max-model-len", "8192", "--foo", "a b")),
        ("--trust-remote-code", ("--trust-remote-code",)),
        # a comma inside quotes: the quote makes it the shell form, the comma stays in the value
        ("--foo 'a,b' --bar", ("--foo", "a,b", "--bar")),
        ('--kv-transfer-config \'{"a": 1, "b": 2}\'', ("--kv-transfer-config", '{"a": 1, "b": 2}')),
        ('--x "say \\"hi\\""', ("--x", 'say "hi"')),
        ("", ()),
        ("   ", ()),
    ],
)
def test_shell_form(value: str, expected: tuple[str, ...]) -> None:
    assert not is_comma_form(value)
    assert parse_extra_args(value) == expected


@pytest.mark.parametrize("value", ["--foo 'a b", '--foo "x', "--foo \\"])
def test_unbalanced_quotes_raise_a_value_error_naming_the_value(value: str) -> None:
    with pytest.raises(ExtraArgsError) as info:
        parse_extra_args(value)
    assert isinstance(info.value, ValueError)
    assert repr(value) in str(info.value)
    assert "comma form" in str(info.value)
