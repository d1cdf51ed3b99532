"""``boundless bench kv-dtype`` on a tiny model: the same memory holds four times the fp32 pool's blocks in fp8, the
batch runs with fewer preemptions, and the rounding's figures come out of real scores; a run with nothing to compare
is refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from boundless.bench import kv_dtype
from boundless.cli import build_parser

# 16 of tiny-llama's fp32 blocks (8 KiB each), 3 of the 6 prompts at a time: 64 in fp8, all 6.
FLAGS = ["--kv-cache-gb", str(16 * 8192 / 2**30), "--max-model-len", "256", "--num-prompts", "6", "--input-len", "60"]
FLAGS += ["--output-len", "8", "--text-tokens", "80"]


def test_fp8_kv_holds_four_times_the_blocks_and_preempts_less(model_dirs: dict[str, Path]) -> None:
    args = build_parser().parse_args(
        ["bench", "kv-dtype", "--model", str(model_dirs["tiny-llama"]), "--kv-cache-dtype", "fp8", *FLAGS]
    )
    result = kv_dtype.run(args)
    base, fp8 = result["batches"]
    assert (base["engine"], fp8["engine"]) == ("KV float32", "KV fp8")
    assert fp8["num_blocks"] == 4 * base["num_blocks"]
    assert fp8["most_running"] > base["most_running"] and fp8["preemptions"] < base["preemptions"]
    rounding = result["rounding"]
    assert rounding["text_tokens"] == 79 and math.isfinite(rounding["compared_nll"])
    assert rounding["mean_logprob_change"] > 0 and 0 < rounding["same_top_token"] <= 1


def test_nothing_to_compare_is_refused(model_dirs: dict[str, Path]) -> None:
    args = build_parser().parse_args(["bench", "kv-dtype", "--model", str(model_dirs["tiny-llama"]), *FLAGS])
    with pytest.raises(SystemExit, match="name the type to compare"):
        kv_dtype.run(args)
    args = build_parser().parse_args(
        ["bench", "kv-dtype", "--model", "m", "--kv-cache-dtype", "fp8", "--num-kv-blocks", "9", *FLAGS]
    )
    with pytest.raises(SystemExit, match="--num-kv-blocks: bench kv-dtype sets it itself"):
        kv_dtype.run(args)
