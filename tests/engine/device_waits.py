"""The calls that would make the host wait for a GPU, caught on the CPU.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` raises on any call that waits for the device; the tests that
launch a step decided ahead run under it there, since such a wait would wait for the step still running and the
overlap would be gone. On the CPU nothing waits, so that check says nothing. :func:`device_waits_refused` refuses the
same calls by what they are: reading a value back (``item``, ``int``/``bool`` of a tensor, ``tolist``) and the ops
whose output size depends on the data (``nonzero``, a boolean mask's indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without its size). So CI catches such a call on the launch path without a GPU.

Not caught here: a copy from pageable host memory to the device (it waits on CUDA; on the CPU there is no copy to
see), which the launch path makes through ``attention.backend.to_device`` only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that read a value back or size their output by the data: each waits for the device on CUDA.
_WAITING_OPS = {
    aten._local_scalar_dense.default,  # item(), int(t), bool(t), float(t)
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}


class DeviceWaitError(AssertionError):
    """A call that would wait for the device, made where none may."""


class _RefuseWaits(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _WAITING_OPS:
            raise DeviceWaitError(f"{func} waits for the device")
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            raise DeviceWaitError("indexing by a boolean mask waits for the device (its size is the mask's count)")
        repeats_given = func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
        if repeats_given and kwargs.get("output_size") is None:
            raise DeviceWaitError("repeat_interleave without output_size waits for the device")
        return func(*args, **kwargs)


# Reading a value back, refused on the tensor class too: under ``torch.inference_mode`` (the engine's steps) a CPU
# tensor's ``item()`` does not reach the dispatch mode.
_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def device_waits_refused() -> Iterator[None]:
    """Raise :class:`DeviceWaitError` on any call in the block that would wait for a GPU (above)."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def refuse(name: str) -> Any:
        def refused(self: torch.Tensor, *args: Any) -> Any:
            raise DeviceWaitError(f"{name}() reads the tensor back: it waits for the device")

        return refused

    for name in _READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        with _RefuseWaits():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
