"""Paged attention, computed as partials and merged exactly.

On the CPU in fp32, one native kernel (:mod:`boundless.attention.cpu_attention`) computes the
partials of every query token of the step straight from the block tables, with no gather.
Elsewhere (other devices and dtypes, or without the kernel) the PyTorch path runs: decodes (one
query token each) are batched, their blocks gathered with one ``index_select`` per step and
layer and scored with batched matmuls across (kv head, sequence); prefill chunks are computed
one sequence at a time, in query tiles bounded in memory. All produce :class:`AttentionPartial`
objects and finish with :func:`merge_partials`, so the same code serves partials computed on
other instances. On the native path the returned tensor is a buffer of the step, overwritten
by the next layer's call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from boundless.attention import cpu_attention
from boundless.attention.backend import AttentionBatch, padded_table
from boundless.attention.partials import AttentionPartial, merge_partials, scores_partial
from boundless.kv.cache_dtype import FP8_DTYPES, from_cache, index_select, store_rows, to_cache


@dataclass
class _PrefillSeq:
    token_start: int
    query_len: int
    context_len: int
    gather_index: torch.Tensor | None  # None: the whole context is this step's tokens
    bias: torch.Tensor | None  # [1, query_len, context_len] causal bias when part of the context is cached
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # the causal bias within each window

    def bias_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The bias of a layer with ``window`` (made at its first layer): -inf past each query and before its
        window's first key."""
        if window is None or window >= self.context_len:
            return self.bias
        if window not in self.window_bias:
            first = self.context_len - self.query_len
            self.window_bias[window] = _window_bias(first, self.query_len, self.context_len, window).to(device)
        return self.window_bias[window]


def _window_bias(first: int, num_queries: int, num_keys: int, window: int | None) -> torch.Tensor:
    """[num_queries, num_keys] of 0 or -inf: queries at positions ``first``, ``first + 1``, ... over keys 0, 1, ...;
    a key is seen when it is at or before the query and (with ``window``) within it (``attention/backend.py``)."""
    q_pos = torch.arange(first, first + num_queries).view(-1, 1)
    k_pos = torch.arange(num_keys).view(1, -1)
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    return torch.zeros(num_queries, num_keys).masked_fill_(hidden, float("-inf")).unsqueeze(0)


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_gather_index: torch.Tensor | None = None
    decode_bias: torch.Tensor | None = None  # [kv_heads * decodes, 1, max_context]; 0 or -inf
    decode_max_context: int = 0
    decode_context: list[int] = field(default_factory=list)
    decode_window_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # decode_bias within each window
    prefills: list[_PrefillSeq] = field(default_factory=list)
    # The native kernel's view of the step (CPU only), and the batch to build the PyTorch
    # metadata from when a layer needs it after all (a non-fp32 cache).
    native: cpu_attention.NativeBatch | None = None
    batch: AttentionBatch | None = None
    buffers: tuple[torch.Tensor, ...] | None = None  # o, m, e, reused by every layer


class TorchPagedAttention:
    """The reference attention backend; runs on any device PyTorch does. ``scale``: the softmax scale (by default
    ``head_dim ** -0.5``; ``ModelArch.attention_scale``); ``softcap``: Gemma 2's cap of the scaled scores, or None."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap

    # -- once per step -----------------------------------------------------------------------

    def _gather_index(self, tables: list[list[int]], num_blocks_each: int, device: torch.device) -> torch.Tensor:
        """Row indices into the cache viewed as [kv_heads * blocks, block_size, head_dim]."""
        flat = padded_table([t[:num_blocks_each] for t in tables], num_blocks_each)
        table = torch.tensor(flat, dtype=torch.long).view(1, -1)
        heads = torch.arange(self.num_kv_heads, dtype=torch.long).view(-1, 1) * self.num_blocks
        return (table + heads).view(-1).to(device)

    def prepare(self, batch: AttentionBatch) -> PagedAttentionMetadata:
        meta = PagedAttentionMetadata(slot_mapping=batch.slot_mapping, num_decodes=batch.num_decodes)
        if cpu_attention.supports(self.head_dim, batch.device):
            meta.native = cpu_attention.make_batch(batch.query_lens, batch.seq_lens, batch.block_tables)
            meta.batch = batch  # the PyTorch metadata is built only if a layer asks for it
            return meta
        self._prepare_torch(meta, batch)
        return meta

    def _prepare_torch(self, meta: PagedAttentionMetadata, batch: AttentionBatch) -> None:
        bs = batch.block_size
        nd = batch.num_decodes
        if nd:
            decode_ctx = batch.seq_lens[:nd]
            nblk = -(-max(decode_ctx) // bs)
            meta.decode_gather_index = self._gather_index(batch.block_tables[:nd], nblk, batch.device)
            meta.decode_max_context = nblk * bs
            meta.decode_context = decode_ctx
            meta.decode_bias = self._decode_bias(meta, None, batch.device)
        start = sum(batch.query_lens[:nd])
        for i in range(nd, len(batch.query_lens)):
            ql, ctx = batch.query_lens[i], batch.seq_lens[i]
            gather, bias = None, None
            if ctx > ql:
                gather = self._gather_index([batch.block_tables[i]], -(-ctx // bs), batch.device)
                bias = _window_bias(ctx - ql, ql, ctx, None).to(batch.device)
            meta.prefills.append(_PrefillSeq(start, ql, ctx, gather, bias))
            start += ql

    def _decode_bias(self, meta: PagedAttentionMetadata, window: int | None, device: torch.device) -> torch.Tensor:
        """[kv_heads * decodes, 1, max_context] of 0 or -inf: each decode's gathered keys past its context, and
        (with ``window``) before its window, hidden."""
        t, ctx = meta.decode_max_context, torch.tensor(meta.decode_context).view(-1, 1)
        pos = torch.arange(t).view(1, -1)
        hidden = pos >= ctx
        if window is not None:
            hidden |= pos <= ctx - 1 - window  # (the decode's query sits at position ctx - 1)
        bias = torch.zeros(len(meta.decode_context), t).masked_fill_(hidden, float("-inf"))
        return bias.view(1, -1, 1, t).expand(self.num_kv_heads, -1, -1, -1).reshape(-1, 1, t).to(device)

    # -- every layer ---------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = cache
        if meta.native is not None:
            if self._native_ok(q, k, v, k_cache):
                return self._forward_native(q, k, v, k_cache, v_cache, meta, window)
            if meta.batch is not None:
                self._prepare_torch(meta, meta.batch)
                meta.batch = None
        # Store the new tokens' KV first: a sequence's attention reads its own new keys from the cache.
        store_rows(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, window)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_cache, v_cache, meta, window)
        for seq in meta.prefills:
            s, e = seq.token_start, seq.token_start + seq.query_len
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, seq, window)
        return out

    def forward_partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
        window: int | None = None,
    ) -> AttentionPartial:
        """As :meth:`forward`, but return the unnormalized partial of every row (m, e [tokens, heads, 1], o
        [tokens, heads, head_dim]), for a caller that merges it with partials computed elsewhere. On the
        native path the tensors are buffers of the step, overwritten by the next layer's call."""
        k_cache, v_cache = cache
        if meta.native is not None:
            if self._native_ok(q, k, v, k_cache):
                o, m, e = self._native_buffers(q, meta)
                assert meta.native is not None
                return cpu_attention.store_and_attend(
                    q, k, v, k_cache, v_cache, meta.slot_mapping, meta.native, self.scale, out=(o, m, e), window=window,
                    softcap=self.softcap,
                )  # fmt: skip
            if meta.batch is not None:
                self._prepare_torch(meta, meta.batch)
                meta.batch = None
        store_rows(k, v, k_cache, v_cache, meta.slot_mapping)
        t, h, _ = q.shape
        m, e, o = torch.empty(t, h, 1, device=q.device), torch.empty(t, h, 1, device=q.device), torch.empty_like(q)
        parts = []
        if meta.num_decodes:
            decodes = q[: meta.num_decodes]
            parts.append((0, meta.num_decodes, self._decode_partial(decodes, k_cache, v_cache, meta, window)))
        for seq in meta.prefills:
            s, end = seq.token_start, seq.token_start + seq.query_len
            parts.append((s, end, self._prefill_partial(q[s:end], k[s:end], v[s:end], k_cache, v_cache, seq, window)))
        for s, end, part in parts:
            m[s:end], e[s:end], o[s:end] = part.m, part.e, part.o
        return AttentionPartial(m=m, e=e, o=o)

    @staticmethod
    def _native_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
        d = q.shape[-1]
        return (
            q.dtype == k.dtype == v.dtype == torch.float32
            and k_cache.dtype in (torch.float32, *FP8_DTYPES)
            and k_cache.device.type == "cpu"
            and k_cache.is_contiguous()
            and all(x.stride(-1) == 1 and x.stride(-2) == d for x in (q, k, v))
        )

    def _forward_native(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        window: int | None,
    ) -> torch.Tensor:
        assert meta.native is not None
        o, m, e = self._native_buffers(q, meta)
        # One local partial: the kernel finishes it (o / e, as merge_partials would) in place.
        cpu_attention.store_and_attend(
            q, k, v, k_cache, v_cache, meta.slot_mapping, meta.native, self.scale, out=(o, m, e), normalize=True,
            window=window, softcap=self.softcap,
        )  # fmt: skip
        return o

    @staticmethod
    def _native_buffers(q: torch.Tensor, meta: PagedAttentionMetadata) -> tuple[torch.Tensor, ...]:
        """The step's o, m, e buffers (made at its first layer)."""
        if meta.buffers is None or meta.buffers[0].shape != q.shape:
            t, h, d = q.shape
            meta.buffers = (torch.empty(t, h, d), torch.empty(t, h, 1), torch.empty(t, h, 1))
            assert meta.slot_mapping.dtype == torch.long and meta.slot_mapping.numel() == t
            meta.slot_mapping = meta.slot_mapping.contiguous()
        return meta.buffers

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        window: int | None,
    ) -> torch.Tensor:
        nd = q.shape[0]
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        out = merge_partials([self._decode_partial(q, k_cache, v_cache, meta, window, layout=False)])
        return out.view(kvh, nd, g, d).transpose(0, 1).reshape(nd, kvh * g, d)

    def _decode_partial(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        window: int | None = None,
        layout: bool = True,
    ) -> AttentionPartial:
        """All single-token queries at once: kv heads and sequences form one batch dimension,
        and each kv head's group of query heads forms the query length. With ``layout``, the
        partial's rows are laid out [tokens, heads, ...] like ``q``'s."""
        nd = q.shape[0]
        kvh, nb, bs, d = k_cache.shape
        g, t = self.group, meta.decode_max_context
        qg = q.view(nd, kvh, g, d).transpose(0, 1).reshape(kvh * nd, g, d)
        idx = meta.decode_gather_index
        assert idx is not None  # (built with the decodes' metadata)
        keys = from_cache(index_select(k_cache.view(kvh * nb, bs, d), 0, idx), q.dtype).view(kvh * nd, t, d)
        values = from_cache(index_select(v_cache.view(kvh * nb, bs, d), 0, idx), q.dtype).view(kvh * nd, t, d)
        bias = meta.decode_bias
        if window is not None and window < max(meta.decode_context):
            if window not in meta.decode_window_bias:
                meta.decode_window_bias[window] = self._decode_bias(meta, window, q.device)
            bias = meta.decode_window_bias[window]
        part = scores_partial(qg, keys, values, self.scale, bias=bias, softcap=self.softcap)
        if not layout:
            return part

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x.view(kvh, nd, g, -1).transpose(0, 1).reshape(nd, kvh * g, -1)

        return AttentionPartial(m=rows(part.m), e=rows(part.e), o=rows(part.o))

    def _prefill(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: _PrefillSeq,
        window: int | None,
    ) -> torch.Tensor:
        """One sequence's chunk of queries against its context (cached prefix and new tokens; within ``window``)."""
        part = self._prefill_partial(q, k_new, v_new, k_cache, v_cache, seq, window, layout=False)
        return merge_partials([part]).transpose(0, 1)

    def _prefill_partial(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: _PrefillSeq,
        window: int | None = None,
        layout: bool = True,
    ) -> AttentionPartial:
        """The partial of one sequence's chunk; rows [tokens, heads, ...] with ``layout``, else [heads, tokens, ...]."""
        kvh, nb, bs, d = k_cache.shape
        ctx = seq.context_len
        if seq.gather_index is None:
            # [kv_heads, ctx, d], rounded as the cache holds them: a chunk reads what a later chunk would.
            keys = from_cache(to_cache(k_new.transpose(0, 1), k_cache.dtype), q.dtype)
            values = from_cache(to_cache(v_new.transpose(0, 1), v_cache.dtype), q.dtype)
        else:
            keys = index_select(k_cache.view(kvh * nb, bs, d), 0, seq.gather_index).view(kvh, -1, d)[:, :ctx]
            values = index_select(v_cache.view(kvh * nb, bs, d), 0, seq.gather_index).view(kvh, -1, d)[:, :ctx]
            keys, values = from_cache(keys, q.dtype), from_cache(values, q.dtype)
        if self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=0)
            values = values.repeat_interleave(self.group, dim=0)
        bias = seq.bias_for(window, q.device)
        part = scores_partial(
            q.transpose(0, 1), keys, values, self.scale, bias=bias, causal=bias is None, softcap=self.softcap
        )
        if not layout:
            return part
        return AttentionPartial(m=part.m.transpose(0, 1), e=part.e.transpose(0, 1), o=part.o.transpose(0, 1))
