"""Live migration of a running request with its whole KV between two engines over a real shared-memory transport:
it continues on the other engine from the moved blocks (a prefix-cache hit there) and its greedy output equals one
engine's that ran it throughout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from boundless.cluster.kv_migration import Endpoint, migrate_request
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.transport.shm import ShmTransport

PROMPT = [(13 * j) % 300 + 3 for j in range(100)]  # 6 full blocks and 4 tokens
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engine(loaded, kv_cache_dtype: str = "auto") -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(num_kv_blocks=24, enable_prefix_caching=True, kv_host_gb=0.0, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=32),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    return EngineCore(
        config,
        layout,
        ModelIdentity.of(loaded, layout),
        loaded.tokenizer,
        build_model_executor(loaded, config, layout),
    )


def _run(core: EngineCore, tokens: dict[str, list[int]], steps: int | None = None) -> None:
    n = 0
    while core.has_unfinished() and (steps is None or n < steps):
        for delta in core.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        n += 1


@pytest.mark.parametrize(("salt", "kv"), [(None, "auto"), ("tenant-a", "auto"), (None, "fp8")])
def test_migrated_request_continues_from_its_moved_blocks(
    tiny_llama, tmp_path: Path, salt: str | None, kv: str
) -> None:
    """With a ``cache_salt`` too: the moved blocks are named there under the salt, as the request's own admission
    looks them up, and a request without it finds none of them. With an fp8 KV cache the blocks move as their bytes
    and the output is that of one fp8 engine."""
    want: dict[str, list[int]] = {}
    one = _engine(tiny_llama, kv)
    params = dataclasses.replace(PARAMS, cache_salt=salt)
    one.add_request("r", PROMPT, params)
    _run(one, want)

    src = Endpoint(_engine(tiny_llama, kv), ShmTransport(tmp_path, "a", timeout_s=10))
    dst = Endpoint(_engine(tiny_llama, kv), ShmTransport(tmp_path, "b", timeout_s=10))
    try:
        got: dict[str, list[int]] = {}
        src.core.add_request("r", PROMPT, params)
        _run(src.core, got, steps=6)  # 4 prefill chunks and 2 decodes: 102 tokens, 6 full blocks computed
        assert len(got["r"]) == 3
        moved = migrate_request(src, dst, "r")
        assert moved is not None and moved.num_blocks == 6
        data = src.core.executor.runner.kv_cache.data
        per_block = data[:, :, :, 0].numel() * data.element_size()
        assert moved.num_bytes == 6 * per_block
        # The source dropped it and its blocks; the destination holds it, its blocks named in its prefix cache.
        assert not src.core.has_unfinished() and src.core.kv.pool.num_used == 0
        assert migrate_request(src, dst, "r") is None  # nothing left to move
        deltas = []
        while dst.core.has_unfinished():
            deltas += dst.core.step()
        got["r"] += [t for d in deltas for t in d.new_token_ids]
        assert deltas[0].num_cached_tokens == 6 * 16  # admitted on the moved blocks, only the tail computed
        assert got["r"] == want["r"]
        assert dst.core.memory_prefix_blocks(PROMPT, params) == 6
        assert dst.core.memory_prefix_blocks(PROMPT, PARAMS) == (6 if salt is None else 0)  # (another tenant's)
    finally:
        src.transport.close()
        dst.transport.close()


def test_a_migration_whose_transfer_fails_changes_nothing(tiny_llama, tmp_path: Path) -> None:
    want: dict[str, list[int]] = {}
    one = _engine(tiny_llama)
    one.add_request("r", PROMPT, PARAMS)
    _run(one, want)

    src = Endpoint(_engine(tiny_llama), ShmTransport(tmp_path, "a", timeout_s=1))
    dst = Endpoint(_engine(tiny_llama), ShmTransport(tmp_path, "b", timeout_s=1))
    try:
        got: dict[str, list[int]] = {}
        src.core.add_request("r", PROMPT, PARAMS)
        _run(src.core, got, steps=6)
        used = src.core.kv.pool.num_used
        dst.transport.close()  # the destination is gone before the blocks travel
        assert migrate_request(src, dst, "r", timeout_s=1.0) is None
        # Both sides as before: the destination took no block, the source still runs the request on its own.
        assert dst.core.kv.pool.num_used == 0 and not dst.core.has_unfinished()
        assert src.core.kv.pool.num_used == used
        _run(src.core, got)
        assert got["r"] == want["r"]
    finally:
        src.transport.close()
        dst.transport.close()
