"""``boundless bench store`` end to end on a few MB: every figure measured, the files it wrote removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.cli import main


def test_bench_store_measures_the_store_against_the_raw_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store.json"
    target = tmp_path / "disk"
    args = ["bench", "store", "--path", str(target), "--gb", "0.005", "--block-size", "4", "--batch-blocks", "16",
            "--chunk-blocks", "4", "--latency-samples", "4", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    figures = json.loads(out.read_text())
    assert figures["blocks"] % 16 == 0 and figures["bytes"] == figures["blocks"] * figures["block_file_bytes"]
    for part in ("raw", "store", "store_1_thread", "chunks"):
        assert all(v > 0 for v in figures[part].values()), part
    assert figures["store_durable"]["write_on_disk_gbps"] > 0
    assert figures["checksum"]["crc32_gbps"] > 0
    assert set(figures["ratios"]) == {
        "write_on_disk", "read_cold", "read_hot", "read_cold_to_plain_files", "read_into_cold", "read_into_hot"
    }  # fmt: skip
    assert all(r > 0 for r in figures["ratios"].values())
    assert list(target.iterdir()) == []  # its subdirectory is gone
    assert "store / raw" in capsys.readouterr().out
