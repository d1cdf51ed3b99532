"""``boundless bench spec`` end to end on a tiny random model: both engines, every kind, the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.cli import main


def test_bench_spec_reports_each_kind_with_identical_greedy_outputs(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    assert main(
        [
            "bench", "spec", "--model", str(model_dirs["tiny-llama"]), "--num-conversations", "2",
            "--max-tokens", "24", "--rounds", "1", "--concurrency", "2", "--kv-cache-gb", "0.05", "--spec", spec,
            "--json", str(out),
        ]
    ) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["spec"]["num_speculative_tokens"] == 3 and result["concurrency"] == 2
    figures = {f["kind"]: f for f in result["figures"]}
    assert set(figures) == {"edit", "extract", "json", "calls", "free"}
    for fig in figures.values():
        assert fig["same_outputs"] == fig["conversations"] == 2  # greedy: speculation changes no token
        assert fig["spec_tokens_per_s"] == fig["output_tokens"] / fig["spec_s"]
        assert fig["speedup"] == pytest.approx(fig["spec_tokens_per_s"] / fig["plain_tokens_per_s"])
        assert 0.0 <= fig["acceptance"] <= 1.0 and fig["tokens_per_pass"] >= 1.0
    assert any(f["acceptance"] > 0 for f in figures.values())
    assert "spec / plain" in capsys.readouterr().out


def test_bench_spec_with_suffix_decoding(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "suffix.json"
    assert main(
        [
            "bench", "spec", "--model", str(model_dirs["tiny-llama"]), "--num-conversations", "3", "--kinds", "calls",
            "--max-tokens", "24", "--rounds", "2", "--kv-cache-gb", "0.05",
            "--spec", '{"method": "suffix", "num_speculative_tokens": 8}', "--json", str(out),
        ]
    ) == 0  # fmt: skip
    (fig,) = json.loads(out.read_text())["figures"]
    # Forced calls: each answer's opening is the one before it's, drafted from the cached outputs.
    assert fig["same_outputs"] == 3 and fig["acceptance"] > 0


def test_bench_spec_refuses_a_speculative_config_of_its_own(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(SystemExit, match="use --spec"):
        main(
            [
                "bench", "spec", "--model", str(model_dirs["tiny-llama"]),
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
            ]
        )  # fmt: skip


def test_bench_spec_of_predicted_outputs(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """``--spec prediction``: a plain engine whose edit calls bring their file as the prediction; the same outputs."""
    out = tmp_path / "prediction.json"
    assert main(
        [
            "bench", "spec", "--model", str(model_dirs["tiny-llama"]), "--num-conversations", "2",
            "--kinds", "edit,free", "--max-tokens", "16", "--rounds", "1", "--kv-cache-gb", "0.05",
            "--spec", "prediction", "--json", str(out),
        ]
    ) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["spec"] == "prediction"
    assert all(f["same_outputs"] == f["conversations"] == 2 for f in result["figures"])
