"""The runner's flat layout of a step: each row's position and KV slot, decodes and chunks in the step's order."""

from __future__ import annotations

import random

import pytest
import torch

from boundless.engine.runner import PositionsAndSlots


def test_positions_and_slots_follow_each_rows_block_table() -> None:
    """A chunk's slots come from the blocks it spans as a run, a decode's as one; in the order given, for chunks
    that start and end mid-block, a table whose first blocks live elsewhere (``first_block``), and a chunk inside one
    block: what a slot per position through the table gives."""
    bs = 16
    rnd = random.Random(0)
    table = rnd.sample(range(1000), 40)
    rows = [("one", 37, 0), ("run", 5, 70, 0), ("one", 100, 2), ("run", 33, 200, 2), ("run", 3, 9, 0), ("one", 1, 0)]
    made = PositionsAndSlots(bs)
    positions, slots = [], []
    for kind, *row in rows:
        if kind == "one":
            pos, first = row
            made.add_one(pos, table[pos // bs - first] * bs + pos % bs)
            span = [pos]
        else:
            start, n, first = row
            made.add_run(start, n, table, first)
            span = list(range(start, start + n))
        positions += span
        slots += [table[p // bs - first] * bs + p % bs for p in span]
    got_positions, got_slots = made.tensors(torch.device("cpu"))
    assert got_positions.dtype == got_slots.dtype == torch.long
    assert got_positions.tolist() == positions and got_slots.tolist() == slots


def test_an_empty_step_has_no_rows() -> None:
    positions, slots = PositionsAndSlots(16).tensors(torch.device("cpu"))
    assert positions.shape == slots.shape == (0,)


def test_a_run_past_its_block_table_is_refused() -> None:
    """A chunk whose positions run past its block table is an error, not a shorter list of slots (a missing slot
    would store a token's KV in another's place)."""
    with pytest.raises(IndexError, match="run past the 2 blocks"):
        PositionsAndSlots(16).add_run(20, 30, [3, 4], 0)
