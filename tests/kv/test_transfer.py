"""Transfers between tiers: batched by pair of tiers, out of the device first, checked against the decided order."""

from __future__ import annotations

import pytest
import torch

from boundless.kv.tensors import PagedKVCache
from boundless.kv.tiers import HostKVTier
from boundless.kv.transfer import (
    DEVICE,
    HOST,
    BlockRef,
    BlockTransfer,
    TransferOrderError,
    apply_transfers,
    plan_transfers,
)

BLOCK = 4


def move(src: tuple[str, int], dst: tuple[str, int]) -> BlockTransfer:
    return BlockTransfer(BlockRef(*src), BlockRef(*dst))


def block_values(tier, ids: list[int]) -> list[float]:
    """Each block holds one value everywhere; read it back through the tier."""
    blocks = tier.read_blocks(ids)
    return [float(blocks[:, :, :, i].unique().item()) for i in range(len(ids))]


def test_a_swap_in_may_fill_the_device_blocks_a_swap_out_of_the_same_step_frees() -> None:
    device = PagedKVCache(2, 2, 8, 4, BLOCK, torch.float32, torch.device("cpu"))
    host = HostKVTier(device, 4)
    device.write_blocks([0, 1], torch.stack([torch.full(device.data[:, :, :, 0].shape, v) for v in (1.0, 2.0)], 3))
    host.write_blocks([2, 3], torch.stack([torch.full(device.data[:, :, :, 0].shape, v) for v in (7.0, 8.0)], 3))
    # Request a leaves device blocks 0 and 1 for host blocks 0 and 1; request b comes back into them.
    transfers = [
        move((DEVICE, 0), (HOST, 0)),
        move((DEVICE, 1), (HOST, 1)),
        move((HOST, 2), (DEVICE, 1)),
        move((HOST, 3), (DEVICE, 0)),
    ]
    plan = plan_transfers(transfers)
    assert [(b.src_tier, b.dst_tier) for b in plan] == [(DEVICE, HOST), (HOST, DEVICE)]
    apply_transfers(transfers, {DEVICE: device, HOST: host})
    assert block_values(host, [0, 1]) == [1.0, 2.0]  # a's KV, copied before b's overwrote it
    assert block_values(device, [0, 1]) == [8.0, 7.0]


def test_a_host_block_a_swap_in_reads_may_not_take_a_swap_out_in_the_same_step() -> None:
    # Run batched, the swap-out would overwrite host block 0 before the swap-in reads it.
    with pytest.raises(TransferOrderError):
        plan_transfers([move((HOST, 0), (DEVICE, 2)), move((DEVICE, 5), (HOST, 0))])


def test_a_request_swapped_in_may_not_be_swapped_out_again_in_the_same_step() -> None:
    # The swap-out would copy device block 2 before the swap-in has filled it.
    with pytest.raises(TransferOrderError):
        plan_transfers([move((HOST, 0), (DEVICE, 2)), move((DEVICE, 2), (HOST, 1))])


def test_a_block_written_twice_in_one_batch_is_refused() -> None:
    with pytest.raises(TransferOrderError):
        plan_transfers([move((DEVICE, 0), (HOST, 3)), move((DEVICE, 1), (HOST, 3))])


def test_a_transfer_to_a_tier_the_executor_lacks_fails_loudly() -> None:
    device = PagedKVCache(1, 1, 1, 2, BLOCK, torch.float32, torch.device("cpu"))
    with pytest.raises(KeyError, match="host"):
        apply_transfers([move((DEVICE, 0), (HOST, 0))], {DEVICE: device})
