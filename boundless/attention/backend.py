"""The interface between the model and an attention implementation.

A backend prepares per-step metadata once (``prepare``) and then, for every layer, writes the
step's new keys and values into the paged cache and computes attention (``forward``). The model
and the scheduler know nothing else about it, so a GPU kernel backend can replace the PyTorch one.

A layer with a sliding window (Mistral's, Qwen2's upper layers: ``ModelArch.layer_windows``) passes ``window``:
a query at position ``p`` then sees the keys at positions ``p - window < j <= p`` (``window`` keys, itself
included), as transformers masks them (``sliding_window_overlay``). Positions are differences, so a sequence whose
leading blocks live elsewhere (``RemoteKV``) masks its local part in local positions alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class RemoteKV:
    """Leading blocks of a sequence's context that another instance (``creditor``) holds, lent under these
    moves (KV lending, ``docs/distributed-attention.md``); their tokens all precede the step's tokens. ``spans``: each
    move's first key among the sequence's remote keys and its tokens, in ``move_ids``' order (a creditor's moves need
    not be contiguous: another's may lie between); empty: one run, right after the entries before it."""

    creditor: str
    move_ids: tuple[str, ...]
    num_tokens: int
    spans: tuple[tuple[int, int], ...] = ()

    def runs(self, first_key: int) -> list[tuple[tuple[str, ...], int, int]]:
        """The moves as runs of contiguous keys: (move ids, first key, tokens) each; ``first_key``: where the keys of
        an entry without ``spans`` begin."""
        if not self.spans:
            return [(self.move_ids, first_key, self.num_tokens)]
        runs: list[tuple[tuple[str, ...], int, int]] = []
        for move_id, (start, tokens) in zip(self.move_ids, self.spans, strict=True):
            if runs and runs[-1][1] + runs[-1][2] == start:
                ids, first, length = runs[-1]
                runs[-1] = (ids + (move_id,), first, length + tokens)
            else:
                runs.append(((move_id,), start, tokens))
        return runs


@dataclass(frozen=True)
class AttentionBatch:
    """The shape of one step's batch, as the runner lays it out.

    Sequences are ordered with the ``num_decodes`` single-token decodes first. Sequence ``i``
    contributes ``query_lens[i]`` consecutive tokens; after the step its context is
    ``seq_lens[i]`` tokens, whose KV lives in the blocks ``block_tables[i]``.

    A sequence whose leading blocks live on other instances has ``remote[i]`` (one entry per creditor);
    ``seq_lens[i]`` and ``block_tables[i]`` then describe only the local rest of its context, which starts
    at a block boundary, so causality within the local part is unchanged. ``remote`` is empty when no
    sequence of the step has remote blocks.
    """

    num_decodes: int
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [tokens] block_id * block_size + offset for each new token
    block_size: int
    device: torch.device
    remote: tuple[tuple[RemoteKV, ...], ...] = ()


class AttentionBackend(Protocol):
    def prepare(self, batch: AttentionBatch) -> Any:
        """Build whatever the backend needs for this step (index tensors, masks)."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        window: int | None = None,
    ) -> torch.Tensor:
        """Store ``k``, ``v`` [tokens, kv_heads, head_dim] in ``cache`` and attend with ``q``
        [tokens, heads, head_dim]; returns [tokens, heads, head_dim]. ``window``: the layer's sliding window
        (None: the whole context)."""
        ...


def window_start(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` sees under ``window`` (the module's rule)."""
    return 0 if window is None else max(0, position - window + 1)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft cap, ``cap * tanh(x / cap)``: of attention's scaled scores (before the mask) and of the logits."""
    return torch.tanh(x / cap) * cap  # (out of place: FlexAttention traces it as a score_mod)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without waiting for it: to a GPU through pinned memory, a copy queued in
    stream order (a copy from pageable memory waits for all the work queued before it, which would stall a host
    launching the next step while the GPU runs this one). PyTorch's pinned allocator keeps the buffer until the copy
    has run."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_ints(
    arrays: Sequence[Sequence[int]], shapes: Sequence[tuple[int, ...]], device: torch.device
) -> list[torch.Tensor]:
    """Int32 arrays (a step's block tables, lengths, indices) on ``device`` in one host-to-device copy (``to_device``):
    a view of it per array, in ``shapes``."""
    dev = to_device(torch.tensor([x for a in arrays for x in a], dtype=torch.int32), device)
    views, offset = [], 0
    for array, shape in zip(arrays, shapes, strict=True):
        views.append(dev[offset : offset + len(array)].view(shape))
        offset += len(array)
    return views


def to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``tensor``'s copy in host memory without waiting for it: from a GPU into pinned memory, queued in stream order
    behind the work that makes it, with an event recorded at its end (the copy is complete once the event has
    passed); a tensor elsewhere is returned as it is, with no event."""
    if not tensor.is_cuda:
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def padded_table(tables: Sequence[Sequence[int]], width: int) -> list[int]:
    """Block tables as one row-major list of ``width`` ids a row, each padded with zeros (a step's tables become one
    tensor from it: a tensor per row cost ~3 us each, a millisecond of a 256-request step). Rows longer than
    ``width`` are not allowed."""
    pad = [0] * width
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += pad[: width - len(t)]
    return flat
