"""``boundless bench tensor-parallel`` on a tiny model: one engine on one device, then one split over two ranks, each
timed; the split engine's greedy answers are the other's; a run with nothing to compare is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from boundless.bench import tensor_parallel
from boundless.cli import build_parser

FLAGS = ["--kv-cache-gb", "0.01", "--max-model-len", "256", "--num-prompts", "4", "--input-len", "40"]
FLAGS += ["--output-len", "8"]


def test_a_split_engine_is_timed_beside_one_device_and_answers_as_it(model_dirs: dict[str, Path]) -> None:
    model = ["--model", str(model_dirs["tiny-llama"])]
    args = build_parser().parse_args(["bench", "tensor-parallel", *model, "--tensor-parallel-size", "2", *FLAGS])
    result = tensor_parallel.run(args)
    one, two = result["engines"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert all(e["decode_step_ms"] > 0 and e["output_tokens_per_s"] > 0 for e in (one, two))
    assert result["same_answers"] == 4
    refused = build_parser().parse_args(["bench", "tensor-parallel", *model, *FLAGS])
    with pytest.raises(SystemExit, match="name the ranks to compare"):
        tensor_parallel.run(refused)
