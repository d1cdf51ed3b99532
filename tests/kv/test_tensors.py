"""The KV pool's memory: zeroed, aligned for huge pages, and taken from the system only as blocks are used."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from boundless.kv.tensors import PagedKVCache


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_pool_is_zero_aligned_and_its_memory_outlives_the_mapping_s_name() -> None:
    cache = PagedKVCache(2, 2, 64, 64, 16, torch.float32, torch.device("cpu"))  # 2 MiB: the huge-page path
    gc.collect()
    assert cache.data.data_ptr() % (2 << 20) == 0
    assert not cache.data.any()
    _, v = cache.layer(1)
    v[1, 3] = 2.0  # written through the view, read back through the whole
    assert cache.data[1, 1, 1, 3].eq(2.0).all() and cache.data.sum() == 2.0 * 16 * 64


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's resident size")
def test_a_large_pool_takes_memory_only_where_blocks_are_written() -> None:
    before = _resident_bytes()
    cache = PagedKVCache(4, 2, 64, 8192, 16, torch.float32, torch.device("cpu"))  # 512 MiB
    assert _resident_bytes() - before < 64 << 20
    cache.write_blocks([5, 6], torch.ones(4, 2, 2, 2, 16, 64))
    assert cache.read_blocks([5, 6]).eq(1.0).all() and cache.read_blocks([7]).eq(0.0).all()
    assert _resident_bytes() - before < 128 << 20
