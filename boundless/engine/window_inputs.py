"""The next pass's inputs in a device window (``DecodeGraphs.launch_window``), made on the device from the tokens the
pass drew: each row still decoding takes its token, moves one position on and gets the slot of that position from its
block table; a row whose passes have ended stays where it was and becomes padding (no KV stored, nothing attended).

One Triton kernel does it: one launch a pass, where PyTorch's ops took about fifteen, each launched from the host
(with windows decided ahead, the host's work per window is about the GPU's). :func:`advance_reference` is the same in
PyTorch ops, for devices without the kernels and for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boundless.attention import triton_paged

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU's path takes PyTorch's ops
    triton = None


@dataclass(frozen=True)
class StepInputs:
    """The input buffers a decode step's graph reads (``DecodeGraphs``), a row per sequence: token, position, KV slot
    (-1: a padding row, nothing stored), context length (0: nothing attended) and block table."""

    input_ids: torch.Tensor  # long
    positions: torch.Tensor  # long
    slots: torch.Tensor  # long
    seq_lens: torch.Tensor  # int32
    block_tables: torch.Tensor  # int32 [rows, max blocks]


def advance_reference(tokens: torch.Tensor, j: int, steps: torch.Tensor, inputs: StepInputs, block_size: int) -> None:
    """Rows ``[0, n)`` of the buffers made ready for the pass after pass ``j`` from that pass's tokens (``tokens``:
    the window's, [window, n]): a row with more passes (``steps > j + 1``) takes its token, one position on, the
    slot there and its context length; the others keep their position, with slot -1 and context length 0."""
    n = tokens.shape[1]
    active = steps > j + 1
    inputs.input_ids[:n].copy_(tokens[j])
    pos = inputs.positions[:n] + active
    inputs.positions[:n].copy_(pos)
    rows = torch.arange(n, device=tokens.device)
    slot = inputs.block_tables[rows, pos // block_size].long() * block_size + pos % block_size
    inputs.slots[:n].copy_(torch.where(active, slot, -1))
    inputs.seq_lens[:n].copy_(torch.where(active, pos + 1, 0))


if triton is not None:
    # (One compiled kernel for every batch size and pass: the window's tokens are passed whole, their row found in
    # the kernel, so the pointer's alignment is the allocation's whatever the pass.)
    @triton.jit(do_not_specialize=["n", "j"])
    def _advance_kernel(
        tokens_ptr, steps_ptr, input_ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr, block_tables_ptr,
        stride_bt, n, j, PAGE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < n
        token = tl.load(tokens_ptr + j.to(tl.int64) * n + rows, mask=ok, other=0)
        active = tl.load(steps_ptr + rows, mask=ok, other=0) > j + 1
        tl.store(input_ids_ptr + rows, token, mask=ok)
        pos = tl.load(positions_ptr + rows, mask=ok, other=0) + active.to(tl.int64)
        tl.store(positions_ptr + rows, pos, mask=ok)
        block = tl.load(block_tables_ptr + rows.to(tl.int64) * stride_bt + pos // PAGE, mask=ok, other=0)
        slot = block.to(tl.int64) * PAGE + pos % PAGE
        tl.store(slots_ptr + rows, tl.where(active, slot, -1), mask=ok)
        tl.store(seq_lens_ptr + rows, tl.where(active, pos + 1, 0).to(tl.int32), mask=ok)


def advance(tokens: torch.Tensor, j: int, steps: torch.Tensor, inputs: StepInputs, block_size: int) -> None:
    """:func:`advance_reference` in one kernel launch where the kernel runs (queued in stream order: nothing waits)."""
    n = tokens.shape[1]
    if triton is None or not triton_paged.available(tokens.device):
        advance_reference(tokens, j, steps, inputs, block_size)
        return
    tables = inputs.block_tables
    assert tokens.is_contiguous() and steps.is_contiguous() and tables.stride(1) == 1
    buffers = (inputs.input_ids, inputs.positions, inputs.slots, inputs.seq_lens)
    assert all(b.stride(0) == 1 for b in buffers)
    assert inputs.input_ids.dtype == inputs.positions.dtype == inputs.slots.dtype == torch.long
    assert inputs.seq_lens.dtype == torch.int32
    block = 256
    _advance_kernel[(triton.cdiv(n, block),)](
        tokens, steps, *buffers, tables, tables.stride(0), n, j, PAGE=block_size, BLOCK=block,
    )  # fmt: skip
