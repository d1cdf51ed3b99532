"""Flags made from the configs' fields (``boundless/config.py``)."""

from __future__ import annotations

import argparse

import pytest

from boundless.config import ModelConfig, add_flags


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
