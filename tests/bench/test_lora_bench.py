"""``boundless bench lora`` end to end on a tiny random model: PEFT, the engine with adapters and without."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from boundless.cli import main


def test_bench_lora_reports_each_system_and_matches_peft(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lora.json"
    assert main(
        [
            "bench", "lora", "--model", str(model_dirs["tiny-llama"]), "--num-adapters", "3", "--rank", "4",
            "--num-prompts", "5", "--input-len", "9", "--output-len", "6", "--repeats", "2",
            "--kv-cache-gb", "0.05", "--json", str(out),
        ]
    ) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"peft", "boundless-lora", "boundless-base"}
    median = {name: statistics.median(s) for name, s in result["seconds"].items()}
    assert all(len(s) == 2 for s in result["seconds"].values())
    assert result["tokens_per_s"]["boundless-lora"] == 5 * 6 / median["boundless-lora"]
    assert result["lora_vs_peft"] == median["peft"] / median["boundless-lora"]
    assert result["lora_cost"] == median["boundless-lora"] / median["boundless-base"]
    # Greedy, fp32, the same adapters: every output equals PEFT's mixed-adapter batch.
    assert result["identical_to_peft"] == 5
    assert "outputs equal to PEFT's: 5/5" in capsys.readouterr().out
