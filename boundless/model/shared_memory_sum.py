"""The tensor-parallel ranks' sum through shared memory, for ranks that share one machine's CPU.

gloo's all-reduce goes through TCP on loopback: about 1 ms for one decode row of a small model on this machine, and a
layer needs two, so two ranks' decode step took 5x one device's (a 30-layer model: 97 ms against 19). vLLM's CPU
backend sums through shared memory for the same reason. Here: one file in ``/dev/shm`` holds, for each rank, a
sequence number (on a cache line of its own) and two slots of ``CHUNK`` bytes. A sum of a tensor goes chunk by chunk:
each rank copies its chunk into its slot, posts the chunk's sequence number, waits until every rank has posted it,
then adds the ranks' slots in rank order into its tensor, so every rank gets the same sum, bit for bit. A rank
waiting yields its core at each check.

Two slots, alternating by sequence number, make a slot's reuse safe: a rank writes a slot again two chunks later,
and it gets there only once every rank has posted the chunk between, which each posts after reading the slot.

The order of a rank's stores (data, then its number) is what another rank sees only on a machine that keeps stores
in order (x86's TSO); elsewhere (ARM) the ranks sum through gloo (:func:`usable`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

CHUNK = 1 << 22  # bytes a rank's slot holds: larger tensors go in chunks
_LINE = 64  # bytes of a cache line: each rank's number on its own
_CHECK_EVERY_S = 0.1  # how often a wait asks whether the other ranks are alive


def usable() -> bool:
    """Whether this machine keeps each core's stores in order as other cores see them (x86)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def file_size(size: int) -> int:
    """Bytes of the file for ``size`` ranks."""
    return _LINE * size + 2 * size * CHUNK


class SharedMemorySum:
    """Rank ``rank`` of ``size``'s sum through the file at ``path`` (made by :func:`create` on rank 0).
    ``alive()``: whether every other rank still runs, asked while a wait is long; ``timeout_s`` bounds each wait."""

    def __init__(self, path: str, rank: int, size: int, alive: Callable[[], bool], timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.alive = alive
        self.timeout_s = timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, file_size(size))
        finally:
            os.close(fd)
        self._numbers = np.frombuffer(self._map, dtype=np.int64, count=_LINE * size // 8)[:: _LINE // 8]
        with torch.inference_mode(False):  # (not an inference tensor, whatever mode the rank starts in)
            data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_LINE * size)
        self._slots = data.view(2, size, CHUNK)
        self._sequence = 0

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """``tensor`` (contiguous, on the CPU) becomes the sum of every rank's, in place."""
        flat = tensor.view(-1)
        per_chunk = CHUNK // tensor.element_size()
        for start in range(0, flat.numel(), per_chunk):
            part = flat[start : start + per_chunk]
            self._sequence += 1
            slots = self._slots[self._sequence % 2, :, : part.numel() * tensor.element_size()].view(tensor.dtype)
            slots[self.rank].copy_(part)
            self._numbers[self.rank] = self._sequence
            self._wait(self._sequence)
            torch.sum(slots, dim=0, out=part)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` [rows, columns] (the same shape on each) side by side in rank order: [rows, ranks x
        columns], some rows at a time (as many as a slot holds)."""
        rows, cols = tensor.shape
        out = torch.empty(rows, self.size * cols, dtype=tensor.dtype, device=tensor.device)
        row_bytes = cols * tensor.element_size()
        if row_bytes > CHUNK:
            raise ValueError(f"a row of {row_bytes} bytes is more than a slot's {CHUNK}")
        per_chunk = CHUNK // row_bytes
        for start in range(0, rows, per_chunk):
            part = tensor[start : start + per_chunk]
            n = part.shape[0]
            self._sequence += 1
            slots = self._slots[self._sequence % 2, :, : n * row_bytes].view(tensor.dtype).view(self.size, n, cols)
            slots[self.rank].copy_(part)
            self._numbers[self.rank] = self._sequence
            self._wait(self._sequence)
            out[start : start + n].view(n, self.size, cols).copy_(slots.transpose(0, 1))
        return out

    def _wait(self, sequence: int) -> None:
        numbers = self._numbers
        checked = start = time.monotonic()
        while int(numbers.min()) < sequence:
            # Each check gives the core up: ranks may share cores (three on two here), and a rank spinning on one
            # holds back the rank it waits for (a decode step of SmolLM2 on three ranks took 141 ms spinning 2,000
            # checks first, 45 ms yielding at once; on two ranks with a core each, yielding cost nothing).
            os.sched_yield()
            now = time.monotonic()
            if now - checked >= _CHECK_EVERY_S:
                checked = now
                if not self.alive():
                    raise RuntimeError("a rank exited while the others waited for its share of a sum")
                if now - start > self.timeout_s:
                    raise RuntimeError(f"a rank's share of a sum did not come in {self.timeout_s:g} s")

    def close(self) -> None:
        del self._slots, self._numbers
        with contextlib.suppress(BufferError):  # (a tensor still views it: the collector closes it later)
            self._map.close()


def create(path: str, size: int) -> None:
    """Make the file for ``size`` ranks at ``path``, every number 0 (rank 0, before the others open it)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        # Its pages taken now (not a sparse file): a /dev/shm too small fails here, not with SIGBUS at the first large
        # sum.
        os.posix_fallocate(fd, 0, file_size(size))
    finally:
        os.close(fd)
