"""``GET /metrics``: Prometheus text, every series labelled by instance."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from boundless.cluster.links import LinkStats
from boundless.engine.core import EngineStats, RequestDelta

StatsSource = Callable[[], dict[str, EngineStats]]  # instance id -> snapshot

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineStateCollector:
    """Gauges and counters read from the engines at scrape time."""

    def __init__(self, source: StatsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        snapshots = self.source()
        gauges = {
            "boundless_num_requests_running": ("requests in the running batch", lambda s: s.num_running),
            "boundless_num_requests_waiting": ("requests waiting to be scheduled", lambda s: s.num_waiting),
            "boundless_kv_blocks_used": ("KV blocks held by requests", lambda s: s.kv_blocks_used),
            "boundless_kv_blocks_total": ("KV blocks in the pool", lambda s: s.kv_blocks_total),
            "boundless_kv_cache_usage_ratio": ("fraction of KV blocks in use", lambda s: s.kv_usage),
            "boundless_prefix_cache_hit_rate": (
                "prompt tokens served by the prefix cache over prompt tokens",
                lambda s: s.prefix_cache_hit_rate,
            ),
            "boundless_programs_tracked": (
                "programs in the scheduler's process table (each until idle past --program-ttl-s)",
                lambda s: s.programs_tracked,
            ),
            "boundless_programs_with_calls": (
                "programs with a call running or waiting",
                lambda s: s.programs_with_calls,
            ),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["instance"])
            for inst, s in snapshots.items():
                g.add_metric([inst], float(get(s)))
            yield g
        counters = {
            "boundless_prompt_tokens": ("prompt tokens of admitted requests", lambda s: s.prompt_tokens),
            "boundless_generation_tokens": ("generated tokens", lambda s: s.generation_tokens),
            "boundless_computed_tokens": ("tokens run through the model", lambda s: s.computed_tokens),
            "boundless_prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                lambda s: s.prefix_cache_queries,
            ),
            "boundless_prefix_cache_hits": ("prompt tokens found in the prefix cache", lambda s: s.prefix_cache_hits),
            "boundless_engine_busy_seconds": ("seconds spent running the model", lambda s: s.busy_seconds),
            "boundless_kv_window_blocks_released": (
                "KV blocks given back to the pool past every layer's sliding window",
                lambda s: s.window_blocks_released,
            ),
            "boundless_spec_decode_drafts": (
                "speculative decoding: requests' steps with drafts (accepted tokens over these: the mean kept)",
                lambda s: s.spec_drafts,
            ),
            "boundless_spec_decode_draft_tokens": (
                "speculative decoding: tokens proposed and verified",
                lambda s: s.spec_draft_tokens,
            ),
            "boundless_spec_decode_accepted_tokens": (
                "speculative decoding: proposed tokens the model's samples matched",
                lambda s: s.spec_accepted_tokens,
            ),
        }
        for name, (doc, get) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["instance"])
            for inst, s in snapshots.items():
                c.add_metric([inst], float(get(s)))
            yield c
        for name, doc, attr in (
            ("boundless_lora_requests_running", "LoRA adapters: running requests, by adapter", "lora_running"),
            ("boundless_lora_requests_waiting", "LoRA adapters: waiting requests, by adapter", "lora_waiting"),
        ):
            g = GaugeMetricFamily(name, doc, labels=["instance", "adapter"])
            for inst, s in snapshots.items():
                for adapter, count in getattr(s, attr).items():
                    g.add_metric([inst, adapter], float(count))
            yield g
        c = CounterMetricFamily(
            "boundless_spec_decode_accepted_tokens_per_position",
            "speculative decoding: drafts kept, by their place among a step's drafts (0: the first)",
            labels=["instance", "position"],
        )
        for inst, s in snapshots.items():
            for position, kept in enumerate(s.spec_accepted_by_position):
                c.add_metric([inst, str(position)], float(kept))
        yield c
        yield from _tier_metrics(snapshots)
        yield from _lending_metrics(snapshots)
        kinds = {"kept": "num_kept", "swapped": "num_swapped_out", "recomputed": "num_recomputed"}
        c = CounterMetricFamily(
            "boundless_preemptions",
            "running requests that lost their place, by what happened to their KV",
            labels=["instance", "kind"],
        )
        for inst, s in snapshots.items():
            for kind, attr in kinds.items():
                c.add_metric([inst, kind], float(getattr(s, attr)))
        yield c


def _lending_metrics(snapshots: dict[str, EngineStats]) -> Iterator[Metric]:
    """KV lending (instances with a lending agent): moves, bytes moved, DistAttention round trips; blocks lent and
    borrowed now."""
    lending = {inst: s.lending for inst, s in snapshots.items() if s.lending is not None}
    if not lending:
        return
    counters = {
        "boundless_kv_lending_moves": ("moves of KV blocks committed, by direction", "moves_out", "moves_in"),
        "boundless_kv_lending_bytes_moved": ("bytes of KV blocks moved, by direction", "bytes_out", "bytes_in"),
    }
    for name, (doc, out_attr, in_attr) in counters.items():
        c = CounterMetricFamily(name, doc, labels=["instance", "direction"])
        for inst, s in lending.items():
            c.add_metric([inst, "out"], float(getattr(s, out_attr)))
            c.add_metric([inst, "in"], float(getattr(s, in_attr)))
        yield c
    plain = {
        "boundless_distattn_round_trips": ("DistAttention partial requests answered, as debtor", "round_trips"),
        "boundless_distattn_round_trip_bytes": ("bytes of those requests and replies", "round_trip_bytes"),
        "boundless_distattn_partials_served": ("DistAttention partial requests served, as creditor", "partials_served"),
        "boundless_distattn_exposed_wait_seconds": (
            "seconds layers waited for creditors after their local partial",
            "exposed_wait_s",
        ),
        "boundless_kv_lending_recomputed_requests": (
            "requests recomputed: blocks lost with a creditor",
            "requests_recomputed",
        ),
        "boundless_kv_lending_held_requests": (
            "requests dropped to recompute and held back to break a lending deadlock",
            "requests_held",
        ),
        "boundless_kv_lending_granted_requests": (
            "requests longer than the pool the gManager let start",
            "requests_granted",
        ),
        "boundless_kv_lending_refused_requests": (
            "requests longer than the pool failed: the live instances could not hold them for the grant timeout",
            "requests_refused",
        ),
    }
    for name, (doc, attr) in plain.items():
        c = CounterMetricFamily(name, doc, labels=["instance"])
        for inst, s in lending.items():
            c.add_metric([inst], float(getattr(s, attr)))
        yield c
    for name, doc, attr in (
        ("boundless_kv_blocks_lent", "KV blocks held for other instances' requests", "blocks_lent"),
        ("boundless_kv_blocks_borrowed", "KV blocks of this instance's requests held by others", "blocks_borrowed"),
    ):
        g = GaugeMetricFamily(name, doc, labels=["instance"])
        for inst, s in lending.items():
            g.add_metric([inst], float(getattr(s, attr)))
        yield g


def _tier_metrics(snapshots: dict[str, EngineStats]) -> Iterator[Metric]:
    """Per KV tier (device, host, disk): hits, bytes, evictions, blocks; the disk store's loads and writes."""
    per_tier = {
        "boundless_kv_tier_hit_tokens": ("prompt tokens whose KV was found in the tier at admission", "hit_tokens"),
        "boundless_kv_tier_read_bytes": ("bytes of KV copied out of the tier", "bytes_read"),
        "boundless_kv_tier_written_bytes": ("bytes of KV copied into the tier", "bytes_written"),
        "boundless_kv_tier_evictions": ("named KV blocks the tier gave up (moved down where it could)", "evictions"),
        "boundless_kv_tier_checksum_failures": (
            "KV blocks of the tier that failed their check when read (truncated, corrupt, another model's): "
            "recomputed, never served",
            "checksum_failures",
        ),
        "boundless_kv_tier_load_timeouts": (
            "loads from the tier a waiting request stopped waiting for after --kv-load-timeout-s (then recomputed)",
            "load_timeouts",
        ),
        "boundless_kv_tier_reloaded_blocks": (
            "KV blocks read from the tier a second time: a waiting request's prefix left memory before its turn",
            "reloaded_blocks",
        ),
    }
    for name, (doc, attr) in per_tier.items():
        c = CounterMetricFamily(name, doc, labels=["instance", "tier"])
        for inst, s in snapshots.items():
            for tier, t in s.kv_tiers.items():
                c.add_metric([inst, tier], float(getattr(t, attr)))
        yield c
    recomputed = CounterMetricFamily(
        "boundless_kv_tier_recomputed_blocks",
        "stored KV blocks a request computed instead of reading from the tier, by why (no_host_room, "
        "unwaited_probe, load_timeout, evicted_before_admission, load_came_back_short)",
        labels=["instance", "tier", "reason"],
    )
    for inst, s in snapshots.items():
        for tier, t in s.kv_tiers.items():
            for reason, n in t.recomputed_blocks.items():
                recomputed.add_metric([inst, tier, reason], float(n))
    yield recomputed
    for name, doc, attr in (
        ("boundless_kv_tier_blocks_used", "KV blocks of the memory tier in use", "blocks_used"),
        ("boundless_kv_tier_blocks_total", "KV blocks of the memory tier", "blocks_total"),
    ):
        g = GaugeMetricFamily(name, doc, labels=["instance", "tier"])
        for inst, s in snapshots.items():
            for tier, t in s.kv_tiers.items():
                if t.blocks_total:
                    g.add_metric([inst, tier], float(getattr(t, attr)))
        yield g
    disk = {
        "boundless_kv_disk_loads": ("loads from the disk store", "loads"),
        "boundless_kv_disk_load_seconds": (
            "seconds loads from the disk store took, summed (mean: / loads)",
            "load_seconds",
        ),
        "boundless_kv_disk_loaded_blocks": ("KV blocks loaded from the disk store", "blocks_loaded"),
        "boundless_kv_disk_missing_blocks": (
            "KV blocks a load found missing or unreadable in the store (recomputed, never served)",
            "blocks_missing",
        ),
        "boundless_kv_disk_written_blocks": ("KV blocks written to the disk store", "blocks_written"),
        "boundless_kv_disk_dropped_blocks": (
            "KV blocks not written because the writer's queue was full",
            "blocks_dropped",
        ),
        "boundless_kv_disk_failed_blocks": ("KV blocks the disk store failed to write", "blocks_failed"),
        "boundless_kv_disk_aged_blocks": (
            "KV blocks put first in the disk store's eviction order: every program that used them finished "
            "(--kv-eviction program)",
            "blocks_aged",
        ),
        "boundless_kv_disk_layerwise_loads": (
            "loads admitted before their storage link had carried them, usable layer by layer (--layerwise-load)",
            "layerwise_loads",
        ),
        "boundless_kv_disk_layer_wait_seconds": (
            "seconds forward passes waited at a layer for a layerwise load's KV to arrive",
            "layer_wait_s",
        ),
        "boundless_kv_disk_layer_wait_timeouts": (
            "layerwise loads whose storage link stalled past --kv-load-timeout-s mid-forward (waited past: the "
            "bytes were in host memory)",
            "layer_wait_timeouts",
        ),
    }
    for name, (doc, attr) in disk.items():
        c = CounterMetricFamily(name, doc, labels=["instance"])
        for inst, s in snapshots.items():
            if s.disk_io is not None:
                c.add_metric([inst], float(getattr(s.disk_io, attr)))
        yield c
    g = GaugeMetricFamily(
        "boundless_kv_disk_store",
        "what the disk store reports of itself (blocks and bytes held, evictions, checksum failures, write errors, "
        "writes_enabled 0 while writes are off after an error...), by stat",
        labels=["instance", "stat"],
    )
    for inst, s in snapshots.items():
        for stat, value in _numbers(s.disk_io.store if s.disk_io is not None else None).items():
            g.add_metric([inst, stat], value)
    yield g


def link_metrics(links: Mapping[str, Sequence[LinkStats]]) -> Iterator[Metric]:
    """The emulated links of each instance (``cluster/links.py``): bytes carried and queued per traffic class,
    busy seconds. The storage link's queued bytes are its node's read queue: under ``--kv-path basic`` the
    prefill instances' fill while the decode instances' stay empty, which is DualPath's bottleneck."""
    carried = CounterMetricFamily(
        "boundless_link_bytes", "bytes carried by the emulated link", labels=["instance", "link", "traffic"]
    )
    queued = GaugeMetricFamily(
        "boundless_link_queued_bytes",
        "bytes waiting for the emulated link or on it (the storage link's: the node's read queue; traffic "
        '"waiting": reads queued at the node\'s store loader, not yet started)',
        labels=["instance", "link", "traffic"],
    )
    busy = CounterMetricFamily(
        "boundless_link_busy_seconds", "seconds the emulated link spent carrying bytes", labels=["instance", "link"]
    )
    for inst, stats in links.items():
        for s in stats:
            for traffic, n in s.bytes_carried.items():
                carried.add_metric([inst, s.name, traffic], float(n))
            for traffic, n in s.bytes_queued.items():
                queued.add_metric([inst, s.name, traffic], float(n))
            busy.add_metric([inst, s.name], s.busy_s)
    yield from (carried, queued, busy)


def _numbers(stats: object) -> dict[str, float]:
    """The numeric fields of a store's stats (a dataclass, a mapping or a plain object)."""
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        items = dataclasses.asdict(stats)
    elif isinstance(stats, Mapping):
        items = dict(stats)
    else:
        items = dict(vars(stats))
    return {k: float(v) for k, v in items.items() if isinstance(v, int | float)}  # a bool is 0 or 1


class _ExtraCollector:
    """Series a client adds of its own at scrape time (a cluster's links and KV paths)."""

    def __init__(self, source: Callable[[], Iterator[Metric]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source()


class ServerMetrics:
    """The server's registry: engine state at scrape time, request latencies as they finish, and ``extra``
    series when the client has some (``cluster_metrics``)."""

    def __init__(self, source: StatsSource, extra: Callable[[], Iterator[Metric]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStateCollector(source))
        if extra is not None:
            self.registry.register(_ExtraCollector(extra))
        labels = ["instance"]
        self.ttft = Histogram(
            "boundless_time_to_first_token_seconds",
            "time from arrival to the first token",
            labels,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "boundless_time_per_output_token_seconds",
            "mean time between output tokens after the first",
            labels,
            registry=self.registry,
            buckets=_TOKEN_BUCKETS,
        )
        self.e2e = Histogram(
            "boundless_e2e_request_latency_seconds",
            "time from arrival to the last token",
            labels,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.finished = Counter(
            "boundless_requests_finished",
            "finished requests by reason",
            ["instance", "finish_reason"],
            registry=self.registry,
        )

    def observe(self, delta: RequestDelta, instance: str = "0") -> None:
        self.finished.labels(instance, delta.finish_reason or "unknown").inc()
        if delta.first_token_time is None or delta.finish_time is None:
            return
        if delta.embedding is None:  # (an embedding request's one token is not an answer: no first token to time)
            self.ttft.labels(instance).observe(delta.first_token_time - delta.arrival_time)
        self.e2e.labels(instance).observe(delta.finish_time - delta.arrival_time)
        if delta.num_output_tokens > 1:
            self.tpot.labels(instance).observe(
                (delta.finish_time - delta.first_token_time) / (delta.num_output_tokens - 1)
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)
