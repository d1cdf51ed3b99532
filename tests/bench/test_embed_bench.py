"""``boundless bench embed`` on a tiny model: transformers' base model and Boundless embed the same prompts, each
timed, and their embeddings agree."""

from __future__ import annotations

import json
from pathlib import Path

from boundless.bench import embed
from boundless.cli import build_parser


def test_both_systems_are_timed_and_their_embeddings_agree(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "embed.json"
    argv = ["bench", "embed", "--model", str(model_dirs["tiny-qwen3"]), "--kv-cache-gb", "0.01"]
    argv += ["--max-model-len", "128", "--num-prompts", "6", "--input-len", "40", "--hf-batch-size", "4"]
    result = embed.run(build_parser().parse_args([*argv, "--repeats", "1", "--json", str(out)]))
    assert set(result["tokens_per_s"]) == {"transformers", "boundless"}
    assert all(v > 0 for v in result["tokens_per_s"].values()) and result["speedup"] > 0
    assert result["max_abs_difference"] < 1e-4 and result["min_cosine"] > 0.9999
    assert json.loads(out.read_text())["num_prompts"] == 6
