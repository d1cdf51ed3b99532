"""DistAttention (Infinite-LLM §4): attention over a context whose leading blocks live on other instances.

An attention backend that wraps the local one. For a step where no sequence has remote blocks it is the local
backend, untouched. Otherwise, in every layer:

1. the query rows of each sequence with remote blocks go to each creditor holding some of them, one message per
   creditor covering every such sequence of the step (``attention/partial_service.py``);
2. meanwhile the local backend stores the step's KV and computes the local partial of every row over the local
   rest of each context (causal within it);
3. the creditors' partials come back and merge exactly with the local ones (``attention/partials.py``): rows
   without remote blocks keep their local partial alone, so their output is bit for bit the local backend's.

The local rest of a context starts at a block boundary after every remote block, so a chunk's queries attend
to all remote tokens (all earlier) and causally to the local ones, as one instance holding everything would. In a
layer with a sliding window each creditor masks its keys by the rows' positions, which the segments carry, and a
creditor whose keys lie before every row's window is not asked at all in that layer.

A model split over tensor-parallel ranks runs one DistributedAttention on every rank, each asking the creditor's
rank of its number for the partials of its heads. A round trip that fails on one rank must not end that rank's pass
alone (the others would wait at the next sum for ever): with ``agree``, a failed creditor's partial counts as empty
and is asked no more in the step, the pass goes on, and after the last layer the ranks sum which creditors failed
anywhere; every rank then raises the same :class:`RemotePartialError`, and the step is dropped as one device's is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from boundless.attention.backend import AttentionBatch
from boundless.attention.partial_service import PartialClient, PendingPartial, RemotePartialError
from boundless.attention.partials import AttentionPartial, combine_partials, merge_partials
from boundless.attention.remote_partials import QuerySegment, encode_segments


@dataclass
class _CreditorPlan:
    """The rows of the step one creditor computes partials for, as segments in row order."""

    rows: list[tuple[int, int]] = field(default_factory=list)  # [start, end) in the step's flat rows
    segments: list[QuerySegment] = field(default_factory=list)
    num_keys: list[int] = field(default_factory=list)  # each segment's lent keys there
    where: torch.Tensor | None = None  # for each of those rows, its index among the step's remote rows
    # A creditor holding two runs of a request's blocks (another creditor's between: ``remote_prefix``) is sent its
    # rows once per run: the reply's rows of each pass over the requests (their indices in the reply, and among the
    # step's remote rows), merged one after another. None: each row once.
    passes: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    encoded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the segments on the wire

    def sees_any(self, window: int | None) -> bool:
        """Whether a row of the plan sees one of the creditor's keys in a layer of sliding ``window``: the keys lent
        long ago lie before every window of the step, and that layer asks nothing of their creditor."""
        return any(s.sees_any(n, window) for s, n in zip(self.segments, self.num_keys, strict=True))


@dataclass
class DistMetadata:
    """The local backend's metadata and, when some sequence has remote blocks, what goes to each creditor."""

    inner: Any
    plans: dict[str, _CreditorPlan] = field(default_factory=dict)
    remote_rows: torch.Tensor | None = None  # the step's rows with remote blocks, sorted
    failed: dict[str, str] = field(default_factory=dict)  # (with ``agree``) creditors whose round trip failed: why


@dataclass
class DistAttentionStats:
    """What DistAttention did so far (cumulative; the round trips' own counts are the client's)."""

    steps: int = 0  # steps with remote blocks
    layers: int = 0  # layer calls with remote blocks
    layer_s: float = 0.0  # seconds in those layer calls (send, local partial, wait, merge)
    send_s: float = 0.0  # of which sending the query rows
    local_s: float = 0.0  # of which computing the local partial (the overlap window)
    exposed_s: float = 0.0  # of which waiting for creditors after the local partial was done
    merge_s: float = 0.0


class DistributedAttention:
    """An attention backend: the ``local`` backend (which must offer ``forward_partial``), plus partials from
    creditors through ``client`` for the sequences whose batch entry lists remote blocks.

    ``caches`` are the layers' (k_cache, v_cache), by which a call's layer is known (the creditor reads that layer's
    blocks). ``agree``: a split model's sum over its ranks (see the module): round-trip failures are agreed after
    the last layer rather than raised where they happen.
    """

    def __init__(
        self,
        local: Any,
        client: PartialClient,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        agree: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.local = local
        self.client = client
        self.agree = agree
        self._layers = {k.data_ptr(): i for i, (k, _) in enumerate(caches)}
        self._last_layer = len(caches) - 1
        self.stats = DistAttentionStats()
        self.fused_layers = getattr(local, "fused_layers", False)

    def prepare(self, batch: AttentionBatch) -> DistMetadata:
        meta = DistMetadata(inner=self.local.prepare(batch))
        if not any(batch.remote):
            return meta
        start = 0
        rows: list[int] = []
        for query_len, seq_len, remote in zip(batch.query_lens, batch.seq_lens, batch.remote, strict=True):
            # The chunk's first position in the whole context: every remote token, then the local ones before it.
            first = sum(kv.num_tokens for kv in remote) + seq_len - query_len
            keys_before = 0
            for kv in remote:
                plan = meta.plans.setdefault(kv.creditor, _CreditorPlan())
                # (A segment per run of contiguous keys: its rows' positions count from its first key.)
                for move_ids, first_key, num_keys in kv.runs(keys_before):
                    plan.rows.append((start, start + query_len))
                    plan.segments.append(QuerySegment(query_len, move_ids, first - first_key))
                    plan.num_keys.append(num_keys)
                keys_before += kv.num_tokens
            if remote:
                rows.extend(range(start, start + query_len))
            start += query_len
        meta.remote_rows = torch.tensor(rows, dtype=torch.long)
        index = {r: i for i, r in enumerate(rows)}
        for plan in meta.plans.values():
            where = [index[r] for s, e in plan.rows for r in range(s, e)]
            plan.where = torch.tensor(where, dtype=torch.long)
            if len(set(where)) < len(where):
                seen: dict[int, int] = {}
                by_pass: dict[int, tuple[list[int], list[int]]] = {}
                at = 0
                for s, e in plan.rows:
                    k = seen[s] = seen.get(s, -1) + 1  # (the k-th run of this request's blocks there)
                    reply, rows_of = by_pass.setdefault(k, ([], []))
                    reply.extend(range(at, at + e - s))
                    rows_of.extend(index[r] for r in range(s, e))
                    at += e - s
                plan.passes = [(torch.tensor(a, dtype=torch.long), torch.tensor(b, dtype=torch.long))
                               for a, b in by_pass.values()]  # fmt: skip
            plan.encoded = encode_segments(plan.segments)
        self.stats.steps += 1
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: DistMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if not meta.plans:
            return self.local.forward(q, k, v, cache, meta.inner, window)
        local, remote = self._partials(q, k, v, cache, meta, window)
        started = time.perf_counter()
        rows = meta.remote_rows
        assert rows is not None
        out = merge_partials([local])
        out[rows] = merge_partials([self._remote_rows(local, remote, meta)]).to(out.dtype)
        self._merged_since(started)
        return out

    def forward_partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: DistMetadata,
        window: int | None = None,
    ) -> AttentionPartial:
        """As :meth:`forward`, the merged partial of every row rather than its output (a model with sinks merges them
        after: ``merge_with_sinks``)."""
        if not meta.plans:
            return self.local.forward_partial(q, k, v, cache, meta.inner, window)
        local, remote = self._partials(q, k, v, cache, meta, window)
        started = time.perf_counter()
        rows = meta.remote_rows
        assert rows is not None
        merged = self._remote_rows(local, remote, meta)  # (of copies of local's rows: written back in place)
        local.m[rows], local.e[rows] = merged.m.to(local.m.dtype), merged.e.to(local.e.dtype)
        local.o[rows] = merged.o.to(local.o.dtype)
        self._merged_since(started)
        return local

    def _merged_since(self, started: float) -> None:
        spent = time.perf_counter() - started
        self.stats.merge_s += spent
        self.stats.layer_s += spent

    def _partials(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: DistMetadata,
        window: int | None,
    ) -> tuple[AttentionPartial, list[tuple[_CreditorPlan, AttentionPartial]]]:
        """The step's local partial of every row and each creditor's of the rows it was sent, its queries sent first
        so that the creditors compute while the local backend does; with ``agree``, the failures settled after the
        last layer."""
        started = time.perf_counter()
        layer = self._layers[cache[0].data_ptr()]
        pending: list[tuple[_CreditorPlan, PendingPartial | None]] = []
        for creditor, plan in meta.plans.items():
            if creditor in meta.failed:  # (agreed at the end: its partials count as empty until then)
                pending.append((plan, None))
                continue
            if not plan.sees_any(window):
                continue
            rows = (
                torch.cat([q[s:e] for s, e in plan.rows])
                if len(plan.rows) > 1
                else q[plan.rows[0][0] : plan.rows[0][1]]
            )
            pending.append((plan, self.client.send(creditor, layer, rows, plan.segments, plan.encoded, window)))
        sent = time.perf_counter()
        local = self.local.forward_partial(q, k, v, cache, meta.inner, window)
        local_done = time.perf_counter()
        remote = [(plan, self._collect(plan, p, meta, local.o).to(q.device)) for plan, p in pending if p is not None]
        collected = time.perf_counter()
        if self.agree is not None and layer == self._last_layer:
            self._settle(meta, q.device)
        done = time.perf_counter()
        s = self.stats
        s.layers += 1
        s.layer_s += done - started
        s.send_s += sent - started
        s.local_s += local_done - sent
        s.exposed_s += collected - local_done
        per_layer = self.client.stats.per_layer_exposed_s
        per_layer[layer] = per_layer.get(layer, 0.0) + collected - local_done
        return local, remote

    def _collect(
        self, plan: _CreditorPlan, pending: PendingPartial, meta: DistMetadata, like: torch.Tensor
    ) -> AttentionPartial:
        """A creditor's partial; with ``agree``, an empty one should its round trip fail (noted in ``meta``)."""
        try:
            return self.client.collect(pending)
        except RemotePartialError as e:
            if self.agree is None:
                raise
            meta.failed[pending.creditor] = str(e)
            rows = sum(end - start for start, end in plan.rows)
            return AttentionPartial(
                m=torch.full((rows, like.shape[1], 1), float("-inf")),
                e=torch.zeros(rows, like.shape[1], 1),
                o=torch.zeros(rows, *like.shape[1:]),
            )

    def _settle(self, meta: DistMetadata, device: torch.device) -> None:
        """After the last layer: sum over the ranks which creditors' round trips failed (each rank lists the step's
        creditors in the same order, from the same batch); raise on every rank if any did on any."""
        assert self.agree is not None
        creditors = list(meta.plans)
        flags = torch.tensor([1.0 if c in meta.failed else 0.0 for c in creditors], device=device)
        self.agree(flags)
        failed = [c for c, f in zip(creditors, flags.tolist(), strict=True) if f > 0]
        if failed:
            why = meta.failed.get(failed[0], "its round trip failed on another rank")
            raise RemotePartialError(failed[0], why.removeprefix(f"creditor {failed[0]}: "))

    @staticmethod
    def _remote_rows(
        local: AttentionPartial, remote: list[tuple[_CreditorPlan, AttentionPartial]], meta: DistMetadata
    ) -> AttentionPartial:
        """The partial of the rows with remote blocks (``meta.remote_rows``, in order): the merge of the local partial
        and each creditor's (the other rows keep the local partial alone)."""
        rows = meta.remote_rows
        assert rows is not None
        sub = AttentionPartial(m=local.m[rows], e=local.e[rows], o=local.o[rows])
        parts = [sub]
        for plan, part in remote:
            # A creditor's partial over the rows it was sent; the rows it was not sent are empty there (m = -inf,
            # e = 0), which the merge leaves unchanged.
            assert plan.where is not None  # (set with the step's plans)
            if plan.passes is None and len(plan.where) == len(rows):
                parts.append(part)  # it was sent every remote row, in order
                continue
            for reply, where in plan.passes or [(torch.arange(len(plan.where)), plan.where)]:
                full = AttentionPartial(
                    m=torch.full_like(sub.m, float("-inf")), e=torch.zeros_like(sub.e), o=torch.zeros_like(sub.o)
                )
                full.m[where], full.e[where], full.o[where] = part.m[reply], part.e[reply], part.o[reply]
                parts.append(full)
        return combine_partials(parts)
