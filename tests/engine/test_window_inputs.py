"""A device window's next-pass inputs: the kernel (on CUDA, or in Triton's interpreter on the CPU) against the same
made by PyTorch's ops."""

from __future__ import annotations

import pytest
import torch

from boundless.attention import triton_paged
from boundless.engine import window_inputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not triton_paged.available(DEVICE), reason="the kernel does not run here")
@pytest.mark.parametrize("n", [1, 7, 300])
def test_the_kernel_makes_the_inputs_pytorch_makes(n: int) -> None:
    """Rows still decoding take their token, move one position on (into a new block at a block's edge) and get its
    slot and context length; finished rows keep their position as padding; rows past ``n`` are not touched."""
    gen = torch.Generator().manual_seed(n)
    block_size, width, rows = 4, 6, n + 5  # (the buffers hold more rows than the window)
    tables = torch.randperm(rows * width, generator=gen)[: rows * width].view(rows, width).to(torch.int32)
    positions = torch.randint(0, block_size * (width - 1) - 1, (rows,), generator=gen)
    positions[0] = block_size - 1  # the next position is the first of a new block
    steps = torch.randint(1, 5, (n,), generator=gen)  # passes per row: rows with 2 or fewer end at pass 2
    steps[0] = 4  # (row 0 goes on, into its next block)
    steps[1:2] = 1  # (row 1, where there is one, has ended)
    state = {
        "input_ids": torch.randint(0, 100, (rows,), generator=gen),
        "positions": positions,
        "slots": torch.randint(-1, 50, (rows,), generator=gen),
        "seq_lens": torch.randint(0, 50, (rows,), generator=gen).to(torch.int32),
    }
    tokens = torch.randint(0, 1000, (3, n), generator=gen)  # (the window's: pass 1's row is taken)
    got = {k: v.clone().to(DEVICE) for k, v in state.items()}
    want = {k: v.clone() for k, v in state.items()}
    window_inputs.advance(
        tokens.to(DEVICE), 1, steps.to(DEVICE), window_inputs.StepInputs(**got, block_tables=tables.to(DEVICE)),
        block_size,
    )  # fmt: skip
    window_inputs.advance_reference(tokens, 1, steps, window_inputs.StepInputs(**want, block_tables=tables), block_size)
    assert torch.equal(want["input_ids"][:n], tokens[1])
    for key in state:
        assert torch.equal(got[key].cpu(), want[key]), key
        assert torch.equal(got[key].cpu()[n:], state[key][n:]), key  # (rows past the window's)
    active = steps > 2
    assert torch.equal(want["slots"][:n][~active], torch.full((int((~active).sum()),), -1))
    assert torch.equal(want["positions"][:n], positions[:n] + active)
    assert int(want["slots"][0]) == int(tables[0, 1]) * block_size  # (row 0 crossed into its next block)
