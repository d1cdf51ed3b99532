"""The ranks' sum through shared memory (``model/shared_memory_sum.py``), ranks run as threads over one file: every
rank gets the ranks' sum in rank order, bit for bit the same, for tensors of several chunks and sums one after another
(the two slots alternating); a rank that is gone, or late past the timeout, makes the others' wait raise."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rank_threads import in_threads

from boundless.model import shared_memory_sum
from boundless.model.shared_memory_sum import SharedMemorySum

pytestmark = pytest.mark.skipif(not shared_memory_sum.usable(), reason="x86's store order")


def _in_threads(size: int, body: Callable[[int, SharedMemorySum], object], path: Path) -> list[object]:
    shared_memory_sum.create(str(path), size)
    sums = [SharedMemorySum(str(path), r, size, lambda: True, 30) for r in range(size)]
    return in_threads(size, lambda rank: body(rank, sums[rank]), 60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_gets_the_sum_in_rank_order(dtype: torch.dtype, tmp_path: Path) -> None:
    size = 3
    # Shapes of a decode row, a prefill chunk, and one of several chunks (its last one short).
    shapes = [(1, 576), (37, 576), (shared_memory_sum.CHUNK // 4 + 1000,)]
    inputs = {
        (r, i, k): torch.randn(shape, generator=torch.Generator().manual_seed(100 * r + 10 * i + k)).to(dtype)
        for r in range(size)
        for i, shape in enumerate(shapes)
        for k in range(3)  # each shape three times in a row: the slots alternate
    }

    def body(rank: int, ranks_sum: SharedMemorySum) -> list[torch.Tensor]:
        got = []
        for k in range(3):
            for i in range(len(shapes)):
                t = inputs[(rank, i, k)].clone()
                ranks_sum.all_reduce_(t)
                got.append(t)
        return got

    results = _in_threads(size, body, tmp_path / "sum")
    n = 0
    for k in range(3):
        for i in range(len(shapes)):
            want = torch.sum(torch.stack([inputs[(r, i, k)] for r in range(size)]), dim=0)
            for r in range(size):
                assert torch.equal(results[r][n], want), (r, i, k)  # type: ignore[index]
            n += 1


def test_a_wait_for_a_rank_that_is_gone_or_late_raises(tmp_path: Path) -> None:
    path = str(tmp_path / "sum")
    shared_memory_sum.create(path, 2)
    alive = [True]
    lonely = SharedMemorySum(path, 0, 2, lambda: alive[0], 30)
    threading.Timer(0.3, lambda: alive.__setitem__(0, False)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a rank exited"):
        lonely.all_reduce_(torch.ones(4))
    assert time.monotonic() - start < 5
    late = SharedMemorySum(path, 0, 2, lambda: True, 0.3)
    late._sequence = 10  # (past the first sum's number, which rank 0 posted above)
    with pytest.raises(RuntimeError, match=r"did not come in 0\.3 s"):
        late.all_reduce_(torch.ones(4))


def test_every_rank_gets_the_ranks_columns_side_by_side(tmp_path: Path) -> None:
    """The logits of a split vocabulary: each rank's [rows, columns] put side by side in rank order, in several pieces
    of rows where a slot holds fewer (and two gathers in a row: the slots alternate)."""
    size, cols = 3, 4096
    many = shared_memory_sum.CHUNK // (cols * 4) * 2 + 7  # (two slots' worth of rows and some)
    inputs = {(r, n): torch.randn(n, cols, generator=torch.Generator().manual_seed(r * 7 + n)) for r in range(size)
              for n in (5, many)}  # fmt: skip

    def body(rank: int, ranks_sum: SharedMemorySum) -> list[torch.Tensor]:
        return [ranks_sum.all_gather(inputs[(rank, n)]) for n in (5, many)]

    results = _in_threads(size, body, tmp_path / "sum")
    for i, n in enumerate((5, many)):
        want = torch.cat([inputs[(r, n)] for r in range(size)], dim=1)
        assert all(torch.equal(results[r][i], want) for r in range(size))  # type: ignore[index]
