"""``boundless bench window`` on small shapes: the engine that gives back the blocks past the window runs more
requests at once than the one keeping them, in the same pool, with the same answers, and serves a context longer than
the pool; a model with a layer over the whole context is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from boundless.bench import window
from boundless.cli import build_parser

FLAGS = ["--num-prompts", "4", "--input-len", "120", "--output-len", "8", "--long-len", "400", "--num-kv-blocks", "20"]
FLAGS += ["--window", "24", "--layers", "2", "--hidden-size", "64", "--max-num-batched-tokens", "64"]


def test_blocks_given_back_run_more_at_once_with_the_same_answers() -> None:
    result = window.run(build_parser().parse_args(["bench", "window", *FLAGS]))
    kept, given = result["batches"]
    assert kept["blocks_released"] == 0 and given["blocks_released"] > 0
    assert given["most_running"] > kept["most_running"]
    assert result["same_answers"] == 1.0
    assert result["long_len"] > result["pool_tokens"] and result["long_seconds"] > 0


def test_a_model_with_a_layer_over_the_whole_context_is_refused(model_dirs: dict[str, Path]) -> None:
    args = build_parser().parse_args(["bench", "window", "--model", str(model_dirs["tiny-qwen2-window"]), *FLAGS])
    with pytest.raises(SystemExit, match="not every layer has a sliding window"):
        window.run(args)
