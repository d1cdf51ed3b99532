"""Faults of the disk KV store, seen from a real server on 127.0.0.1 through the official ``openai`` client
(issue 12): a damaged block file is detected, counted in ``/metrics`` and recomputed, never served; a full disk
or an unwritable directory leaves the server serving with writes off, a warning and a metric; a directory
another model or block size wrote gives no hits and loses nothing; a read that hangs ends in a load timeout,
after which the waiting request is admitted and recomputes.

A "restart" is a new engine and server on the same directory with nothing in memory (the bench
``boundless bench restart`` restarts real processes); the store is the real one (``kv/disk_store.py``) on
pytest's temporary directory.
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from boundless.api.launch import ServerThread, start_in_thread
from boundless.config import CacheConfig, EngineConfig, ModelConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.kv.block_file import HEADER_SIZE
from boundless.kv.block_hash import BlockHash, extend_block_hashes
from boundless.kv.disk_store import DiskKVStore, StoreLayout
from boundless.kv.tensors import PagedKVCache
from boundless.kv.tiers import BlockStore
from boundless.model.loader import LoadedModel

NAME = "tiny"
BLOCK = 16
PROMPT = [(13 * j) % 300 + 3 for j in range(70)]  # four full blocks before the last token
OTHER = [(7 * j) % 300 + 5 for j in range(70)]


@dataclass
class Served:
    engine: AsyncEngine
    server: ServerThread
    client: openai.OpenAI

    def complete(self, prompt: list[int]) -> openai.types.Completion:
        return self.client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)

    def metrics(self) -> str:
        return httpx.get(self.server.url + "/metrics").text

    def settle(self) -> None:
        """Wait for the store's writer, then run one step: its report brings the store's stats to /metrics."""
        self.engine.core.executor.kv_io.flush()
        self.complete([3, 4, 5])


@contextmanager
def serve(
    loaded: LoadedModel, path: Path, store: BlockStore | None = None, block_size: int = BLOCK, **cache: object
) -> Iterator[Served]:
    """A fresh engine (nothing in memory) and server on the disk store at ``path`` (``store``, else the real one
    the builder opens there); stopping it drains the store's writer, as a server process does on exit."""
    arch = loaded.arch
    per_block = PagedKVCache.bytes_per_block(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, loaded.dtype
    )
    host_gb = 64.5 * per_block / (1 << 30)  # 64 host blocks (the default GiB takes long to allocate)
    config = EngineConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(
            num_kv_blocks=32,
            block_size=block_size,
            kv_host_gb=host_gb,
            kv_disk_path=str(path),
            kv_write_policy="through",
            **cache,
        ),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    executor = build_model_executor(loaded, config, layout, store=store)
    engine = AsyncEngine(EngineCore(config, layout, ModelIdentity.of(loaded, layout), loaded.tokenizer, executor))
    server = start_in_thread(engine, NAME)
    try:
        yield Served(engine, server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))
    finally:
        server.stop()
        engine.shutdown()


def metric(text: str, name: str, **labels: str) -> float:
    inner = ",".join(['instance="0"', *(f'{k}="{v}"' for k, v in labels.items())])
    match = re.search(re.escape(f"{name}{{{inner}}}") + r" (\S+)", text)
    assert match is not None, f"{name}{{{inner}}} missing"
    return float(match.group(1))


def block_file(root: Path, loaded: LoadedModel, prompt: list[int], index: int) -> Path:
    key = extend_block_hashes([], prompt, BLOCK, loaded.fingerprint)[index]
    (path,) = root.rglob(key.hex() + ".kv")
    return path


def cached(completion: openai.types.Completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


# -- damaged files --------------------------------------------------------------------------------


def truncate(path: Path, loaded: LoadedModel) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def flip_a_bit(path: Path, loaded: LoadedModel) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 100] ^= 0x04
    path.write_bytes(data)


def another_models_file(path: Path, loaded: LoadedModel) -> None:
    """A whole, valid file for the same key written by another model of the same shapes: only its header tells."""
    theirs = StoreLayout(
        **{**StoreLayout.of_model(loaded, BLOCK, loaded.fingerprint).__dict__, "fingerprint": "another-model"}
    )
    store = DiskKVStore(path.parents[3] / "elsewhere", theirs, 1 << 30)
    key: BlockHash = bytes.fromhex(path.stem)
    store.write([key], torch.randn(theirs.block_shape).to(theirs.dtype).unsqueeze(3))
    shutil.copyfile(next(store.dir.rglob("*.kv")), path)


@pytest.mark.parametrize("damage", [truncate, flip_a_bit, another_models_file], ids=lambda f: f.__name__)
def test_a_damaged_block_file_is_counted_and_recomputed_never_served(
    tiny_llama: LoadedModel, tmp_path: Path, damage: Callable[[Path, LoadedModel], None]
) -> None:
    store = tmp_path / "kv"
    with serve(tiny_llama, store) as s:
        cold = s.complete(PROMPT)
    damage(block_file(store, tiny_llama, PROMPT, 1), tiny_llama)
    with serve(tiny_llama, store) as s:  # restarted: only the store has the prompt's blocks
        again = s.complete(PROMPT)
        text = s.metrics()
    assert again.choices[0].text == cold.choices[0].text
    assert cached(again) == BLOCK  # the block before the damaged one; the rest was computed
    assert metric(text, "boundless_kv_tier_checksum_failures_total", tier="disk") == 1
    assert metric(text, "boundless_kv_tier_hit_tokens_total", tier="disk") == BLOCK
    # The damaged file was removed, its block computed again and written through: the next start hits on all.
    with serve(tiny_llama, store) as s:
        third = s.complete(PROMPT)
        text = s.metrics()
    assert third.choices[0].text == cold.choices[0].text and cached(third) == 4 * BLOCK
    assert metric(text, "boundless_kv_tier_checksum_failures_total", tier="disk") == 0


# -- full disk, unwritable directory --------------------------------------------------------------


def no_space_left(path: Path) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def test_a_full_disk_leaves_the_server_serving_with_writes_off_a_warning_and_a_metric(
    tiny_llama: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The file system refuses every write halfway through its first file, as a full disk does.
    full = DiskKVStore(
        tmp_path, StoreLayout.of_model(tiny_llama, BLOCK, tiny_llama.fingerprint), 1 << 30, mid_write=no_space_left
    )
    with caplog.at_level(logging.WARNING, logger="boundless.kv.disk_store"), serve(tiny_llama, tmp_path, full) as s:
        first = s.complete(PROMPT)
        other = s.complete(OTHER)
        again = s.complete(PROMPT)
        s.settle()
        text = s.metrics()
    assert [c.choices[0].finish_reason for c in (first, other, again)] == ["length"] * 3
    assert again.choices[0].text == first.choices[0].text and cached(again) == 4 * BLOCK  # from memory
    assert metric(text, "boundless_kv_disk_store", stat="write_errors") >= 1  # the first call's files, side by side
    assert metric(text, "boundless_kv_disk_store", stat="writes_enabled") == 0
    assert metric(text, "boundless_kv_disk_store", stat="writes_dropped") > 0
    assert metric(text, "boundless_kv_disk_failed_blocks_total") > 0
    assert sum("writes off" in r.getMessage() for r in caplog.records) == 1
    assert list(tmp_path.rglob("*.kv")) == [] and list(tmp_path.rglob("*.tmp")) == []


def test_an_unwritable_directory_is_read_with_writes_off_a_warning_and_a_metric(
    tiny_llama: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture, make_unwritable: Callable
) -> None:
    with serve(tiny_llama, tmp_path) as s:
        cold = s.complete(PROMPT)
    files = sorted(tmp_path.rglob("*.kv"))
    undo = make_unwritable(tmp_path)
    if undo is None:
        pytest.skip("cannot make a directory unwritable here")
    try:
        with caplog.at_level(logging.WARNING, logger="boundless.kv.disk_store"), serve(tiny_llama, tmp_path) as s:
            again = s.complete(PROMPT)  # read from the store
            other = s.complete(OTHER)  # its blocks cannot be written
            s.settle()
            text = s.metrics()
    finally:
        undo()
    assert again.choices[0].text == cold.choices[0].text and cached(again) == 4 * BLOCK
    assert other.choices[0].finish_reason == "length"
    assert metric(text, "boundless_kv_tier_hit_tokens_total", tier="disk") == 4 * BLOCK
    assert metric(text, "boundless_kv_disk_store", stat="write_errors") >= 1
    assert metric(text, "boundless_kv_disk_store", stat="writes_enabled") == 0
    assert sum("writes off" in r.getMessage() for r in caplog.records) == 1
    assert sorted(tmp_path.rglob("*.kv")) == files


# -- another model or block size ------------------------------------------------------------------


@pytest.mark.parametrize("other", ["block-size-8", "tiny-qwen2"])
def test_a_directory_another_model_or_block_size_wrote_gives_no_hits_and_loses_nothing(
    load: Callable[[str], LoadedModel], tmp_path: Path, other: str
) -> None:
    tiny_llama = load("tiny-llama")
    with serve(tiny_llama, tmp_path) as s:
        cold = s.complete(PROMPT)
    ours = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.kv")}
    assert len(ours) == 4
    model, block_size = (tiny_llama, 8) if other == "block-size-8" else (load(other), BLOCK)
    arch = model.arch
    file_bytes = HEADER_SIZE + PagedKVCache.bytes_per_block(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, model.dtype
    )
    room = 2.5 * file_bytes / (1 << 30)  # two of its blocks: it evicts its own as it writes
    with serve(model, tmp_path, block_size=block_size, kv_disk_gb=room) as s:
        s.complete(PROMPT)
        s.complete(OTHER)
        s.settle()
        text = s.metrics()
    assert metric(text, "boundless_kv_tier_hit_tokens_total", tier="disk") == 0
    assert metric(text, "boundless_kv_disk_store", stat="evictions") > 0
    assert {p: p.stat().st_mtime_ns for p in ours} == ours  # neither read nor removed
    with serve(tiny_llama, tmp_path) as s:
        again = s.complete(PROMPT)
    assert again.choices[0].text == cold.choices[0].text and cached(again) == 4 * BLOCK


# -- stuck storage --------------------------------------------------------------------------------


def test_a_read_that_hangs_ends_in_a_load_timeout_and_the_request_recomputes(
    tiny_llama: LoadedModel, tmp_path: Path, gated_store: type
) -> None:
    with serve(tiny_llama, tmp_path) as s:
        cold = s.complete(PROMPT)
        cold_other = s.complete(OTHER)
    stuck = gated_store(DiskKVStore(tmp_path, StoreLayout.of_model(tiny_llama, BLOCK, tiny_llama.fingerprint), 1 << 30))
    try:
        with serve(tiny_llama, tmp_path, stuck, kv_load_timeout_s=0.3) as s:
            again = s.complete(PROMPT)  # its blocks are found (a stat works), but reading them hangs
            other = s.complete(OTHER)  # on disk too: while the stuck read lasts, nothing waits for the store
            text = s.metrics()
            stuck.release.set()
    finally:
        stuck.release.set()
    assert again.choices[0].text == cold.choices[0].text and cached(again) == 0
    assert other.choices[0].text == cold_other.choices[0].text and cached(other) == 0
    assert metric(text, "boundless_kv_tier_load_timeouts_total", tier="disk") == 1
    assert metric(text, "boundless_kv_tier_reloaded_blocks_total", tier="disk") == 0  # the series is there
    assert metric(text, "boundless_kv_tier_hit_tokens_total", tier="disk") == 0
