"""Paged attention with PyTorch's FlexAttention (``torch.nn.attention.flex_attention``), a kernel library of the field.

FlexAttention generates a fused attention kernel from two small functions: which (query, key) pairs attend
(``mask_mod``) and a :class:`BlockMask` that lists, per tile of queries, the key blocks worth visiting (those
wholly visible, which skip ``mask_mod``, and those partly visible). Paged attention is one mask and one block mask:

- The keys are the whole KV pool of a layer, viewed without a copy as one sequence per KV head: the cache is
  [kv_heads, blocks, block_size, head_dim], so physical slot ``s`` is key ``s``.
- A launch runs a set of sequences, one batch row each, with their queries padded to the longest (decodes: one).
  The block mask lists each query tile's blocks from the sequence's block table: the blocks wholly before the
  tile's first query are full, those up to its last query partial. A tile of padding lists nothing, so padding
  costs memory, not work. Each sequence visits its own blocks only: no gather, no padding of the context.
- ``mask_mod`` maps a key's physical block to its logical index in the row's sequence (an inverse block table
  per launch, ``logical``: -1 where the block is not the sequence's) and keeps it when it is causal for the query.
  It is exact on its own: PyTorch's eager reference (the CPU, the tests) applies it to every pair, the kernel
  only to partial blocks.

A layer with a sliding window (``forward``'s ``window``: a query at ``p`` sees keys ``p - window < j <= p``) reads a
block mask of its own, made with the whole context's for every window declared at construction (``windows``): its
``mask_mod`` also drops the keys before the window, and its lists leave out every block wholly before the window of
each query of the tile (a long context's decode visits the window's blocks alone). A prefill tile's blocks are then
partial at the window's start, full between (seen whole by every query), and partial up to its last query (a decode's
all partial, as without a window); the launch's masks share their inverse block table.

A step is two launches, its decodes and its prefill chunks (vLLM's FlexAttention backend packs every token into
one row instead, so a tile of 16 decodes visits all 16 sequences' blocks). The log-sum-exp comes out with the
output, so DistAttention's partials (``forward_partial``) work from it as from the Triton kernels.

On CUDA the call is compiled by ``torch.compile`` (Triton kernels; a few compiles over an engine's shapes), and
decode steps replay as CUDA graphs (``decode_metadata``: the block masks over the graph's buffers, remade before each
pass). On the CPU it runs PyTorch's eager reference, which builds every (query, key) score of the pool: a correctness
path for tests and small pools, not a fast one (the CPU's fast path is ``TorchPagedAttention``'s native kernel).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from boundless.attention import triton_paged
from boundless.attention.backend import AttentionBatch, padded_table, soft_cap, to_device, upload_ints
from boundless.attention.partials import PartialsFromLse

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError:  # pragma: no cover - PyTorch before 2.9 has no AuxRequest
    flex_attention = None  # type: ignore[assignment]


def available() -> bool:
    """Whether this PyTorch has FlexAttention with its log-sum-exp output (2.9 or later)."""
    return flex_attention is not None


DECODE_TILE = 128
# The fewest keys a tile of the GPU kernel may hold (Triton's matrix product wants an inner size of 16), and so the
# smallest page: a key tile is a page.
MIN_GPU_PAGE = 16
# The most fp32 scores (bytes) a step's eager reference may make off CUDA: it scores every query against the pool.
EAGER_SCORE_BYTES = 1 << 30


class BlockLists(NamedTuple):
    """A block mask's key blocks per query tile: counts [seqs, 1, tiles], ids [seqs, 1, tiles, width]; int32."""

    partial_counts: torch.Tensor
    partial_ids: torch.Tensor
    full_counts: torch.Tensor | None  # (None: no block listed full)
    full_ids: torch.Tensor | None


class MaskTensors(NamedTuple):
    """A launch's block lists, one set per window (None: the whole context), and what their masks read: the inverse
    block table [seqs, pool blocks + 1] (the last column a sink for padding), each sequence's query count and first
    query position."""

    lists: dict[int | None, BlockLists]
    logical: torch.Tensor
    query_lens: torch.Tensor
    first_positions: torch.Tensor

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor, in an order two masks of the same windows share."""
        listed = [t for lists in self.lists.values() for t in lists]
        return [*listed, self.logical, self.query_lens, self.first_positions]


@dataclass
class FlexLaunch:
    """One FlexAttention call over the sequences whose tokens are rows ``[start, end)`` of the step's q."""

    start: int
    end: int
    num_seqs: int
    query_len: int  # the launch's queries per sequence, padded to the longest
    rows: torch.Tensor | None  # [tokens] each token's row in the padded [num_seqs * query_len]; None: one each
    # torch.nn.attention.flex_attention.BlockMask of the whole context (None) and of each declared window
    block_masks: dict[int | None, Any]
    kernel_options: dict[str, int]  # the compiled kernel's tile sizes (the eager reference has none)


@dataclass
class FlexAttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64; -1 stores nothing (padding rows)
    launches: list[FlexLaunch] = field(default_factory=list)
    # Log-sum-exp of every (token, head) of the last layer run with this metadata: [tokens, heads] fp32.
    lse: torch.Tensor | None = None
    # Metadata over buffers the caller refills (CUDA graphs, ``decode_metadata``): remakes the block mask's tensors
    # in place from them; run before each forward pass, inside the captured graph.
    refresh: Callable[[], None] | None = None


# Compiles of FlexAttention one process may make before torch.compile refuses another (an error under fullgraph, not
# the eager reference, which on a GPU would score every query against the whole pool): each new tile size, and each
# new shape where shapes are static.
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(dynamic: bool | None) -> Callable[..., Any]:
    """FlexAttention compiled for CUDA. ``dynamic`` None: a compile per shape until one changes, then sizes that
    change are symbolic (a symbolic batch loses the decoding kernel, which packs a KV head's query heads into one
    program); False: a compile per shape."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)


def softcap_score(softcap: float) -> Callable[..., torch.Tensor]:
    """FlexAttention's ``score_mod`` of Gemma 2's cap of the scaled scores (:func:`backend.soft_cap`)."""

    def capped(score: torch.Tensor, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return soft_cap(score, softcap)

    return capped


class FlexPagedAttention(PartialsFromLse):
    """Paged attention with FlexAttention: compiled on CUDA, PyTorch's eager reference elsewhere. ``scale``: the
    softmax scale (by default ``head_dim ** -0.5``); ``softcap``: Gemma 2's cap of the scaled scores (a
    ``score_mod``), or None."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        prefill_tile: int | None = None,
        dynamic: bool | None = None,
        windows: Sequence[int] = (),
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        if not available():
            raise RuntimeError("the flex attention backend needs PyTorch 2.9 or later (FlexAttention's AuxRequest)")
        if any(w < 1 for w in windows):
            raise ValueError(f"a sliding window holds at least one key: windows {list(windows)}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self._score_mod = softcap_score(softcap) if softcap else None
        self.on_gpu = device.type == "cuda"
        if self.on_gpu and block_size < MIN_GPU_PAGE:
            raise ValueError(
                f"FlexAttention on CUDA reads a page a key tile, and a tile needs {MIN_GPU_PAGE} keys: "
                f"--block-size {block_size} is too small"
            )
        # Whether calls go through torch.compile (``_compiled``): on CUDA; a test may turn it on elsewhere, with a
        # compiler of its own, to see what the engine's steps make torch.compile do.
        self.compiled = self.on_gpu
        # The layers around attention: the fused Triton kernels on a GPU, as with the Triton backend.
        self.fused_layers = self.on_gpu
        # Block lists as wide as the pool (the CPU's compiled kernel wants them so), or only as wide as they need be
        # (the GPU's kernel reads only the counted entries); a test may lay them out as the GPU's on the CPU.
        self.pool_wide_lists = not self.on_gpu
        # Query rows per tile of a prefill launch (the kernel's BLOCK_M: 16 or more, a power of two); keys per tile are
        # a page (BLOCK_N: the block mask's key blocks are pages, and a tile may not span two).
        self.prefill_tile = prefill_tile or 64
        self.dynamic = dynamic  # torch.compile's: see _compiled
        # The sliding windows the layers attend within: each launch makes a block mask for each (and the whole context).
        self.windows = tuple(sorted(set(windows)))
        self._graph_inverse: torch.Tensor | None = None  # decode_metadata's inverse tables, one buffer

    # -- once per step -----------------------------------------------------------------------

    def prepare(self, batch: AttentionBatch) -> FlexAttentionMetadata:
        meta = FlexAttentionMetadata(slot_mapping=batch.slot_mapping)
        nd, n = batch.num_decodes, len(batch.query_lens)
        start = 0
        for lo, hi in ((0, nd), (nd, n)):
            if lo == hi:
                continue
            qlens = batch.query_lens[lo:hi]
            tokens = sum(qlens)
            meta.launches.append(
                self._launch(start, qlens, batch.seq_lens[lo:hi], batch.block_tables[lo:hi], decode=hi <= nd)
            )
            start += tokens
        return meta

    def _launch(
        self, start: int, qlens: list[int], seq_lens: list[int], tables: list[list[int]], decode: bool
    ) -> FlexLaunch:
        b = len(qlens)
        query_len = max(qlens)
        width = max(1, max(len(t) for t in tables))
        # Query rows per tile: a decode's one query sits in a tile of 128 (FlexAttention's decoding kernel packs a KV
        # head's query heads into rows of at least 16 and wants the tile a multiple of them); a prefill's tiles are
        # ``prefill_tile`` rows whatever its length (a tile is part of what a compile is made for: one size, one
        # compile).
        tile = DECODE_TILE if decode else self.prefill_tile
        table, qlen, seq_len = upload_ints(
            [padded_table(tables, width), qlens, seq_lens], [(b, width), (b,), (b,)], self.device
        )
        qlen, seq_len = qlen.long(), seq_len.long()
        first_pos = seq_len - qlen  # the position of each sequence's first query
        rows = None
        if query_len > 1:  # each token's row in the padded queries: sequence * query_len + offset
            counts = torch.tensor(qlens)
            starts = torch.cumsum(counts, 0) - counts  # each sequence's first token among the launch's
            pad = torch.arange(b) * query_len - starts  # a token's row less its index, for each sequence's tokens
            rows = to_device(torch.arange(int(counts.sum())) + pad.repeat_interleave(counts), self.device)
        masks = self._make_block_masks(
            self._mask_tensors(table, qlen, seq_len, first_pos, query_len, tile, decode), query_len, tile
        )
        return FlexLaunch(start, start + sum(qlens), b, query_len, rows, masks, self._kernel_options(decode, tile))

    def _kernel_options(self, decode: bool, tile: int) -> dict[str, int]:
        """The compiled kernel's tiles: a tile of keys may not span two pages (the block mask's key blocks); a
        prefill's tile of queries is its block mask's (a decode's, the decoding kernel sizes itself)."""
        return {"BLOCK_N": min(self.block_size, 128)} | ({} if decode else {"BLOCK_M": tile})

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start: torch.Tensor,
        programs: torch.Tensor,
        max_context: int,
    ) -> FlexAttentionMetadata:
        """Metadata of a decode-only step over tensors the caller fills before each run (CUDA-graph replay), as
        ``TritonPagedAttention.decode_metadata``: a padding row has slot -1 and context length 0, and attends to
        nothing. The block masks' tensors (the whole context's and each window's) live at fixed addresses; ``refresh``
        remakes them from the buffers."""
        b = seq_lens.shape[0]
        ones = torch.ones(b, dtype=torch.long, device=seq_lens.device)

        def made(logical: torch.Tensor | None = None) -> MaskTensors:
            seq_len = seq_lens.long()
            return self._mask_tensors(block_tables, ones, seq_len, seq_len - 1, 1, DECODE_TILE, True, logical)

        held = made()
        # The inverse tables ([rows, pool blocks] each, the bulk) of every bucket share one buffer: a replay remakes
        # its rows before reading them, and the buckets replay one at a time.
        shared = self._graph_inverse
        if shared is None or shared.shape[0] < b or shared.dtype != held.logical.dtype:
            shared = self._graph_inverse = torch.empty_like(held.logical)
        held = held._replace(logical=shared[:b].copy_(held.logical))

        def refresh() -> None:
            fresh = made(held.logical)  # (the inverse table remade in place)
            for mine, new in zip(held.tensors(), fresh.tensors(), strict=True):
                if mine is not None and new is not None and new is not mine:
                    mine.copy_(new)

        masks = self._make_block_masks(held, 1, DECODE_TILE)
        launch = FlexLaunch(0, b, b, 1, None, masks, self._kernel_options(True, DECODE_TILE))
        return FlexAttentionMetadata(slot_mapping=slot_mapping, launches=[launch], refresh=refresh)

    def _mask_tensors(
        self,
        table: torch.Tensor,
        qlen: torch.Tensor,
        seq_len: torch.Tensor,
        first_pos: torch.Tensor,
        query_len: int,
        tile: int,
        decode: bool = False,
        logical: torch.Tensor | None = None,
    ) -> MaskTensors:
        """A launch's block lists (the whole context's and each window's) and inverse block table, made on the device
        from its block tables (no wait for it). ``logical``: the inverse table to remake in place ([seqs, pool blocks
        + 1]), else a new one. ``decode``: see ``_block_lists``."""
        bs, dev = self.block_size, table.device
        b, width = table.shape
        # The inverse block table: each row's logical index of every physical block (-1: not its block).
        if logical is None:
            small = width < torch.iinfo(torch.int16).max
            logical = torch.empty((b, self.num_blocks + 1), dtype=torch.int16 if small else torch.int32, device=dev)
        logical.fill_(-1)
        owned = torch.arange(width, device=dev)[None, :] < (seq_len[:, None] + bs - 1) // bs
        index = torch.where(owned, table.long(), self.num_blocks)  # a padding entry goes to a column no key reads
        logical.scatter_(1, index, torch.arange(width, device=dev, dtype=logical.dtype).expand(b, width))
        lists = {
            window: self._block_lists(table, qlen, first_pos, query_len, tile, decode, window)
            for window in (None, *self.windows)
        }
        return MaskTensors(lists, logical, qlen, first_pos)

    def _block_lists(
        self,
        table: torch.Tensor,
        qlen: torch.Tensor,
        first_pos: torch.Tensor,
        query_len: int,
        tile: int,
        decode: bool,
        window: int | None,
    ) -> BlockLists:
        """Each query tile's key blocks under ``window`` (None: the whole context), in the order of the sequence's
        table: partial from the first block its first query's window reaches (without a window, none), full from the
        first wholly within its last query's window to the last wholly at or before its first query, then partial up
        to its last query's block. ``decode``: every block listed partial, none full. FlexAttention's decoding kernel
        splits a sequence's context over programs by its partial blocks; it gives every full block to the last split,
        which would read a long context alone."""
        bs, dev = self.block_size, table.device
        b, width = table.shape
        tiles = -(-query_len // tile)
        t = torch.arange(tiles, device=dev)
        live = t * tile < qlen[:, None]  # a tile holding a query of the sequence (not padding only)
        lo = first_pos[:, None] + t * tile  # its first and last query positions
        hi = first_pos[:, None] + torch.minimum((t + 1) * tile, qlen[:, None]) - 1
        last = hi // bs
        full_end = (lo + 1) // bs  # past the blocks wholly at or before the first query
        if window is None:
            start = full_start = torch.zeros_like(lo)
        else:
            start = (lo - window + 1).clamp(min=0) // bs
            full_start = torch.minimum(-((hi - window + 1).clamp(min=0) // -bs), full_end)  # (none full: full_end)
        listed = table[:, None, :].expand(b, tiles, width)

        def picked(first: torch.Tensor, n: int) -> torch.Tensor:  # each tile's n entries of its table from first on
            picks = (first[:, :, None] + torch.arange(n, device=dev)).clamp_(0, width - 1)
            return listed.gather(2, picks.long())

        as_int = torch.int32
        if decode:  # (one tile: the blocks from the window's start, in order, all partial)
            count = torch.where(live, last + 1 - start, 0)
            ids = listed if window is None else picked(start, min(width, -(-(window - 1) // bs) + 1))
            ids = self._widened(ids, ids.shape[-1])[:, None].to(as_int).contiguous()
            return BlockLists(count[:, None].to(as_int), ids, None, None)
        span = -(-tile // bs) + 1  # the most blocks a tile's queries reach into (at its last query, or window's start)
        leading = full_start - start  # the partial blocks at the window's start (0 without a window)
        j = torch.arange(span if window is None else 2 * span, device=dev)
        picks = torch.where(j < leading[:, :, None], start[:, :, None] + j, (full_end - leading)[:, :, None] + j)
        partial_ids = listed.gather(2, picks.clamp_(0, width - 1).long())
        partial = torch.where(live, leading + last + 1 - full_end, 0)
        full = torch.where(live, full_end - full_start, 0)
        full_ids = listed if window is None else picked(full_start, min(width, max(1, window // bs)))
        lists = max(full_ids.shape[-1], partial_ids.shape[-1])
        return BlockLists(
            partial[:, None].to(as_int), self._widened(partial_ids, lists)[:, None].to(as_int).contiguous(),
            full[:, None].to(as_int), self._widened(full_ids, lists)[:, None].to(as_int).contiguous(),
        )  # fmt: skip

    def _widened(self, ids: torch.Tensor, width: int) -> torch.Tensor:
        """A block list padded to ``width`` entries, or to the pool's blocks (``pool_wide_lists``). The partial and
        the full lists must be as wide: FlexAttention's GPU kernel (PyTorch 2.11's) finds a tile's full list with the
        partial list's strides."""
        return F.pad(ids, (0, (self.num_blocks if self.pool_wide_lists else width) - ids.shape[-1]))

    def _make_block_masks(self, m: MaskTensors, query_len: int, tile: int) -> dict[int | None, Any]:
        """The :class:`BlockMask` of each window (None: the whole context) over these tensors (read by reference:
        refilling them in place changes it)."""
        bs = self.block_size
        logical, qlen, first_pos = m.logical, m.query_lens, m.first_positions

        def made(lists: BlockLists, window: int | None) -> Any:
            def mask_mod(bi: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                block = logical[bi, kv // bs].to(torch.int64)
                key, query = block * bs + kv % bs, first_pos[bi] + qi  # positions
                seen = (qi < qlen[bi]) & (block >= 0) & (key <= query)
                return seen if window is None else seen & (key > query - window)

            return BlockMask.from_kv_blocks(
                *lists,
                BLOCK_SIZE=(tile, bs),
                mask_mod=mask_mod,
                seq_lengths=(query_len, self.num_blocks * bs),
                compute_q_blocks=False,
            )

        return {window: made(lists, window) for window, lists in m.lists.items()}

    # -- every layer ---------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: FlexAttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None and window not in self.windows:
            raise ValueError(
                f"sliding window {window} was not declared to the flex attention backend (windows "
                f"{list(self.windows)}): its block masks are made for the declared windows alone"
            )
        k_cache, v_cache = cache
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        kvh, nb, bs, d = k_cache.shape
        keys = k_cache.view(1, kvh, nb * bs, d)  # the pool as one sequence per KV head: slot s is key s
        values = v_cache.view(1, kvh, nb * bs, d)
        if len(meta.launches) == 1 and meta.launches[0].end - meta.launches[0].start == q.shape[0]:
            out, meta.lse = self._attend(q, keys, values, meta.launches[0], window)  # (a step of one kind: no copies)
            return out
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[0], self.num_heads), float("-inf"), dtype=torch.float32, device=q.device)
        for launch in meta.launches:
            rows_out, rows_lse = self._attend(q[launch.start : launch.end], keys, values, launch, window)
            out[launch.start : launch.end] = rows_out
            lse[launch.start : launch.end] = rows_lse
        meta.lse = lse
        return out

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, launch: FlexLaunch, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output [tokens, heads, head_dim] and log-sum-exp [tokens, heads] of one launch's rows (``window``: within
        that sliding window)."""
        b, ql = launch.num_seqs, launch.query_len
        if launch.rows is None:
            queries = q.view(b, 1, self.num_heads, self.head_dim)
        else:
            queries = q.new_zeros(b * ql, self.num_heads, self.head_dim)
            queries[launch.rows] = q
            queries = queries.view(b, ql, self.num_heads, self.head_dim)
        call: Callable[..., Any] = flex_attention
        if self.compiled:
            call = _compiled(self.dynamic)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o, aux = call(
                queries.transpose(1, 2),
                keys,
                values,
                block_mask=launch.block_masks[window],
                score_mod=self._score_mod,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
                return_aux=AuxRequest(lse=True),
                kernel_options=launch.kernel_options if self.compiled else None,
            )
        o = o.transpose(1, 2).reshape(b * ql, self.num_heads, self.head_dim)
        lse = aux.lse.transpose(1, 2).reshape(b * ql, self.num_heads).float()
        if launch.rows is not None:
            o, lse = o[launch.rows], lse[launch.rows]
        return o, lse

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` [tokens, kv_heads, head_dim] into the cache at ``slots`` (-1: nowhere)."""
        if k.shape[0] == 0:
            return
        if self.on_gpu:  # the Triton backend's store kernel: it skips slot -1 without a wait for the device
            triton_paged.store_kv(k, v, k_cache, v_cache, slots)
            return
        kvh, nb, bs, d = k_cache.shape
        keep = slots >= 0
        k_cache.view(kvh, nb * bs, d)[:, slots[keep]] = k[keep].transpose(0, 1)
        v_cache.view(kvh, nb * bs, d)[:, slots[keep]] = v[keep].transpose(0, 1)
