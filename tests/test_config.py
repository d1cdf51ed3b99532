"""Flags made from the configs' fields (``boundless/config.py``)."""

from __future__ import annotations

import argparse
import math

import pytest

from boundless.config import ConfigError, ModelConfig, add_flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, ModelConfig)
    return parser


@pytest.mark.parametrize(
    ("given", "tokens"),
    [
        ("8192", 8192),
        ("32k", 32_000),
        ("25.6k", 25_600),
        ("16.1k", 16_100),
        ("4.1m", 4_100_000),
        ("32K", 32_768),
        ("1M", 2**20),
        ("auto", None),
        ("-1", None),
    ],
)
def test_max_model_len_takes_vllms_human_readable_lengths(given: str, tokens: int | None) -> None:
    """``--max-model-len 128k`` (vLLM's form, as model cards write it) was refused by argparse, "invalid int value"."""
    assert _parser().parse_args(["--max-model-len", given]).max_model_len == tokens


@pytest.mark.parametrize("given", ["1.5K", "32x", "0", "0.0001k", ""])
def test_a_max_model_len_that_is_no_length_is_refused_naming_the_flag(given: str) -> None:
    with pytest.raises(argparse.ArgumentError, match="--max-model-len"):
        _parser().parse_args(["--max-model-len", given])


def test_the_offline_config_takes_the_flags_forms_of_a_context() -> None:
    """``LLM(max_model_len="auto")``, ``-1`` and ``"32k"`` as the flag reads them (a string raised a TypeError from a
    comparison); a string that is no length is the flag's one-line error."""
    from boundless.config import ConfigError, ModelConfig

    assert [ModelConfig(max_model_len=v).max_model_len for v in ("auto", -1, "32k", "8192", 4096)] == [
        None, None, 32_000, 8192, 4096,
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="--max-model-len: not a context length"):
        ModelConfig(max_model_len="lots")


def _float_fields() -> list[tuple[type, str]]:
    import dataclasses

    from boundless.config import CacheConfig, ClusterConfig, SchedulerConfig, ServerConfig

    return [
        (cls, f.name)
        for cls in (CacheConfig, SchedulerConfig, ServerConfig, ClusterConfig)
        for f in dataclasses.fields(cls)
        if f.type in ("float", "float | None")
    ]


@pytest.mark.parametrize(("config", "name"), _float_fields())
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_number_flag_that_is_not_finite_is_refused_naming_the_flag(config: type, name: str, value: float) -> None:
    """argparse reads ``inf`` and ``nan`` as floats: ``--kv-cache-gb inf`` and ``--max-body-mb inf`` passed their
    flags' checks and failed after the model loaded, with an OverflowError's traceback."""
    with pytest.raises(ConfigError, match=f"^--{name.replace('_', '-')}: "):
        config(**{name: value})


def test_help_gives_no_default_of_none_against_the_default_a_flag_says() -> None:
    """``--kv-host-gb``'s help said "(default 1.0)" and argparse's "(default: None)" after it."""
    from boundless.cli import _subcommand, build_parser

    text = " ".join(_subcommand(build_parser(), "serve").format_help().split())
    assert "(default: None)" not in text and "(default: )" not in text
    assert "(default 1.0) (default" not in text and "(default: 2048)" in text
