"""The disk KV store under a model split over two tensor-parallel ranks (``--tensor-parallel-size 2
--kv-disk-path``): each rank keeps its share of every block (its key/value heads) in files of its own, a restarted
split engine loads them and answers as transformers, and a block whose share one rank lacks is recomputed on both
(``kv/split_reads.py``), then written again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from boundless.config import CacheConfig, EngineConfig, ModelConfig
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.block_file import HEADER_SIZE
from boundless.kv.block_hash import extend_block_hashes
from boundless.kv.disk_store import StoreLayout
from boundless.kv.transfer import DISK
from boundless.model.loader import LoadedModel, load_configured_model

MAX_NEW = 8
BLOCK = 16
SHARED = [(7 * j) % 300 + 3 for j in range(3 * BLOCK)]  # three blocks both conversations start with
PROMPTS = [SHARED + list(range(100, 133)), SHARED + list(range(200, 221))]


def _config(model: Path, disk: Path, ranks: int = 2) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=str(model), max_model_len=256, tensor_parallel_size=ranks),
        CacheConfig(
            kv_cache_gb=0.01, kv_host_gb=0.01, kv_disk_path=str(disk), kv_disk_gb=1.0, kv_write_policy="through"
        ),
    )


def _greedy(config: EngineConfig) -> tuple[list[list[int]], int]:
    """Each prompt's greedy answer from a fresh split engine, one after the other, and the prompt tokens the engine
    found on disk."""
    core = EngineCore.from_model(load_configured_model(config.model), config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    answers = []
    try:
        for i, prompt in enumerate(PROMPTS):
            core.add_request(str(i), prompt, params)
            tokens: list[int] = []
            while core.has_unfinished():
                for delta in core.step():
                    tokens.extend(delta.new_token_ids)
            answers.append(tokens)
        return answers, core.stats().kv_tiers[DISK].hit_tokens
    finally:
        core.close()


def _transformers(model: Any) -> list[list[int]]:
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]  # fmt: skip


def _rank_dir(config: EngineConfig, disk: Path, rank: int) -> Path:
    loaded = load_configured_model(config.model, rank=rank)
    layout = StoreLayout.of_model(loaded, BLOCK, loaded.fingerprint)
    return disk / layout.digest().hex()


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])  # (4: five processes, 2 cores)
def test_a_restarted_split_engine_loads_each_ranks_share_of_the_blocks_an_earlier_one_wrote(
    ranks: int,
    model_dirs: dict[str, Path],
    load: Callable[[str], LoadedModel],
    hf_model: Callable[[str], Any],
    tmp_path: Path,
) -> None:
    """Two ranks, one of tiny-llama's two key/value heads each; four, each head held by two ranks."""
    config = _config(model_dirs["tiny-llama"], tmp_path, ranks)
    expected = _transformers(hf_model("tiny-llama"))
    cold, cold_hits = _greedy(config)
    assert cold == expected and cold_hits == 0
    dirs = [_rank_dir(config, tmp_path, rank) for rank in range(ranks)]
    names = [{f.name for f in d.rglob("*.kv")} for d in dirs]
    assert all(n == names[0] for n in names) and len(names[0]) == 3 + 2 + 1  # the shared blocks, then each one's own
    # A rank's file holds its one key/value head of tiny-llama's two: half a block, after the header.
    arch = load("tiny-llama").arch
    half = arch.num_layers * 2 * (arch.num_kv_heads // 2) * BLOCK * arch.head_dim * 4
    assert {f.stat().st_size for d in dirs for f in d.rglob("*.kv")} == {HEADER_SIZE + half}

    warm, warm_hits = _greedy(config)  # nothing in memory: every full block of both prompts comes from disk
    assert warm == expected
    assert warm_hits == (3 + 2) * BLOCK + 1 * BLOCK


@pytest.mark.slow  # (7 s of ranks starting)
def test_blocks_one_rank_lacks_are_recomputed_on_every_rank_and_written_again(
    model_dirs: dict[str, Path], hf_model: Callable[[str], Any], tmp_path: Path
) -> None:
    """Rank 1's share of the first prompt's blocks after the first is deleted (rank 0 still has its share): the loads
    stop where rank 1's stopped, both ranks compute the rest, answers are transformers', and rank 1's files are written
    again."""
    config = _config(model_dirs["tiny-llama"], tmp_path)
    expected = _transformers(hf_model("tiny-llama"))
    assert _greedy(config)[0] == expected
    fingerprint = load_configured_model(config.model).fingerprint
    keys = extend_block_hashes([], PROMPTS[0], BLOCK, fingerprint)
    rank1 = _rank_dir(config, tmp_path, 1)
    for key in keys[1:]:
        (rank1 / key.hex()[:2] / f"{key.hex()}.kv").unlink()
    answers, hits = _greedy(config)
    assert answers == expected
    # From disk: the first prompt's first block, and the second's own block (the shared ones are in memory by then).
    assert hits == 1 * BLOCK + 1 * BLOCK
    assert all((rank1 / key.hex()[:2] / f"{key.hex()}.kv").is_file() for key in keys)
