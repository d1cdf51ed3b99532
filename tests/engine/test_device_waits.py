"""The CPU's stand-in for CUDA's sync debug mode (``device_waits.py``): each call that waits for a GPU is refused in
the block, and the calls that only queue work pass."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from device_waits import DeviceWaitError, device_waits_refused

x = torch.arange(6, dtype=torch.float32)
rows = torch.tensor([0, 2])


@pytest.mark.parametrize(
    "call",
    [
        lambda: x.sum().item(),
        lambda: int(x[0]),
        lambda: bool(x[1] > 0),
        lambda: float(x.max()),
        lambda: x.tolist(),
        lambda: torch.nonzero(x),
        lambda: x[x > 2],
        lambda: torch.masked_select(x, x > 2),
        lambda: torch.unique(x),
        lambda: torch.repeat_interleave(x, rows.repeat(3)),
        lambda: torch.equal(x, x),
    ],
    ids=["item", "int", "bool", "float", "tolist", "nonzero", "mask-index", "masked_select", "unique",
         "repeat_interleave", "equal"],
)  # fmt: skip
@pytest.mark.parametrize("inference", [False, True], ids=["", "inference_mode"])
def test_each_call_that_waits_is_refused(call: Callable[[], object], inference: bool) -> None:
    """Also under ``torch.inference_mode`` (the engine's steps), where a CPU tensor's ``item()`` does not reach a
    dispatch mode."""
    with torch.inference_mode(inference), device_waits_refused(), pytest.raises(DeviceWaitError):
        call()
    call()  # (allowed again after the block)


def test_calls_that_only_queue_work_pass() -> None:
    with device_waits_refused():
        y = torch.where(x > 2, x, 0.0).argmax()
        z = x.index_select(0, rows) + torch.repeat_interleave(x[:2], rows, output_size=2)
        w = torch.empty(4).copy_(x[:4]).masked_fill_(x[:4] > 1, 0.0)
    assert int(y) == 5 and z.tolist() == [1.0, 3.0] and w.tolist() == [0.0, 1.0, 0.0, 0.0]
