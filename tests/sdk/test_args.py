"""An inferlet's arguments from the words after ``--`` (``pie run``) or a host's JSON (``pie serve``): typed by its
pydantic model, and every name it does not know, lacks or cannot read refused in one line that names it."""

from __future__ import annotations

import pytest

from inferlet.errors import ArgumentError, UsageError
from inferlet.text.arguments import CompletionArgs, DecodeArgs, parse_arg_dict, parse_args


async def completion(args: CompletionArgs) -> dict:
    return {}


async def speculative(args: DecodeArgs) -> dict:
    return {}


async def untyped(args: dict) -> dict:
    return {}


def test_words_become_the_models_typed_fields():
    args = parse_args(["--prompt", "hi", "--max-tokens", "8", "--chat", "--stop", "a", "--stop", "b"], completion)
    assert (args.prompt, args.max_tokens, args.chat, args.stop) == ("hi", 8, True, ["a", "b"])


def test_a_misspelt_name_is_refused_with_the_name_it_resembles():
    with pytest.raises(ArgumentError) as e:
        parse_args(["--prompt", "hi", "--draft-schedul", "fixed"], speculative)
    assert str(e.value) == "unknown argument: --draft-schedul (did you mean --draft-schedule?)"


def test_every_unknown_name_is_named_even_with_no_near_one():
    with pytest.raises(ArgumentError, match=r"unknown arguments: --colour, --zzz$"):
        parse_args(["--prompt", "hi", "--zzz", "1", "--colour", "red"], completion)


def test_a_missing_or_unreadable_field_names_its_flag():
    with pytest.raises(ArgumentError, match=r"^--prompt: Field required$"):
        parse_args(["--max-tokens", "3"], completion)
    with pytest.raises(ArgumentError, match=r"^--max-tokens: Input should be greater than or equal to 1$"):
        parse_args(["--prompt", "hi", "--max-tokens", "0"], completion)
    with pytest.raises(ArgumentError, match=r"^--temperature: Input should be a valid number"):
        parse_args(["--prompt", "hi", "--temperature", "warm"], completion)
    with pytest.raises(ArgumentError, match="expected --name, got 'hi'"):
        parse_args(["hi"], completion)


def test_the_error_is_a_usage_error_for_pie_run_and_a_value_error_for_the_host():
    with pytest.raises(ArgumentError) as e:
        parse_arg_dict({"prompt": "hi", "max_tokenz": 3}, completion)
    assert isinstance(e.value, UsageError) and isinstance(e.value, ValueError)
    assert str(e.value) == "unknown argument: max_tokenz (did you mean max_tokens?)"  # JSON names, not flags


def test_an_inferlet_taking_a_dict_gets_every_word():
    assert parse_args(["--n", "3", "--name", "x", "--on"], untyped) == {"n": 3, "name": "x", "on": True}


def test_a_number_given_to_a_text_argument_stays_text():
    """``--prompt 42``: a typed inferlet's str field and a dict inferlet's ``prompt`` (and ``stop``, the other
    name CompletionArgs types as text) get the word as given; other numbers in a dict still become numbers."""
    assert parse_args(["--prompt", "42", "--stop", "7"], completion).prompt == "42"
    assert parse_args(["--prompt", "42", "--stop", "7", "--n", "3", "--t", "0.5"], untyped) == {
        "prompt": "42",
        "stop": "7",
        "n": 3,
        "t": 0.5,
    }
