"""Emulated storage and network links: rate, traffic isolation, counters, virtual time and threads."""

from __future__ import annotations

import threading

import pytest

from boundless.cluster.links import Link, ThrottledLink, Traffic, gbps_to_bytes_per_s, instance_links
from boundless.config import ClusterConfig

RATE = 1000.0  # bytes per second
CHUNK = 100  # bytes: one chunk crosses in 0.1 s
CT = CHUNK / RATE


def link(kv_share: float = 0.0) -> Link:
    return Link("storage", RATE, chunk_bytes=CHUNK, kv_share=kv_share)


def test_bytes_cross_at_the_rate_back_to_back_and_an_idle_link_starts_afresh() -> None:
    lk = link()
    a = lk.submit(250, now=1.0)
    b = lk.submit(100, now=1.0)
    assert lk.estimated_finish(a) == pytest.approx(1.25) and lk.estimated_finish(b) == pytest.approx(1.35)
    assert lk.advance(1.3) == [a]
    assert lk.advance(2.0) == [b]
    c = lk.submit(500, now=5.0)  # the link idled since 1.35: c starts when it arrives
    assert lk.next_finish() == pytest.approx(5.5)
    assert lk.advance(10.0) == [c] and c.finished_at == pytest.approx(5.5)
    z = lk.submit(0, now=11.0)
    assert lk.advance(11.0) == [z]


def test_model_traffic_overtakes_kv_traffic_at_the_next_chunk() -> None:
    lk = link()
    kv = lk.submit(10 * CHUNK, now=0.0, traffic=Traffic.KV)
    lk.advance(0.5 * CT)
    model = lk.submit(CHUNK, now=0.5 * CT, traffic=Traffic.MODEL)
    done = lk.advance(100.0)
    # The KV chunk on the wire finishes (t = 1 chunk), then the model chunk; the link never idles.
    assert done == [model, kv]
    assert model.finished_at == pytest.approx(2 * CT) and kv.finished_at == pytest.approx(11 * CT)


def test_kv_traffic_keeps_its_share_while_model_traffic_is_busy() -> None:
    for share, kv_done in ((0.0, 103 * CT), (0.25, 12 * CT)):
        lk = link(kv_share=share)
        lk.submit(100 * CHUNK, now=0.0, traffic=Traffic.MODEL)
        kv = lk.submit(3 * CHUNK, now=0.0, traffic=Traffic.KV)
        lk.advance(1000.0)
        # Strict priority: KV waits for all 100 model chunks. A 25% share: every 4th chunk is KV's.
        assert kv.finished_at == pytest.approx(kv_done), share


def arrivals() -> list[tuple[float, int, Traffic]]:
    return [(0.0, 730, Traffic.KV), (0.03, 120, Traffic.MODEL), (0.31, 999, Traffic.KV), (0.4, 50, Traffic.MODEL)]


def run(lk: Link, step: float | None) -> dict[int, float]:
    """Feed the arrivals, advancing in steps of ``step`` seconds (None: only at arrivals and finishes)."""
    finished: dict[int, float] = {}
    pending = arrivals()
    now = 0.0
    while pending or lk.next_finish() is not None:
        next_arrival = pending[0][0] if pending else float("inf")
        now = max(now, min(lk.next_finish() or float("inf"), next_arrival) if step is None else now + step)
        while pending and pending[0][0] <= now:
            at, n, traffic = pending.pop(0)
            lk.submit(n, at, traffic)
        for t in lk.advance(now):
            finished[t.transfer_id] = t.finished_at  # type: ignore[assignment]
    return finished


def test_the_schedule_does_not_depend_on_how_often_the_link_is_advanced() -> None:
    by_events = run(link(kv_share=0.2), None)
    by_small_steps = run(link(kv_share=0.2), 0.007)
    assert by_events == by_small_steps  # exactly: finish times are start + bytes / rate
    assert len(by_events) == 4 and max(by_events.values()) == pytest.approx(1899 / RATE)


def test_an_estimate_holds_when_nothing_arrives_and_only_model_traffic_can_push_it_back() -> None:
    lk = link()
    kv = lk.submit(5 * CHUNK, now=0.0)
    estimate = lk.estimated_finish(kv)
    assert kv.finished_at is None  # estimating does not move the link
    lk.submit(2 * CHUNK, now=0.2, traffic=Traffic.MODEL)
    lk.advance(10.0)
    assert estimate == pytest.approx(5 * CT) and kv.finished_at == pytest.approx(7 * CT)


def test_counters_split_carried_and_queued_bytes_by_class_and_count_busy_time_only() -> None:
    lk = link()
    lk.submit(1000, now=0.0)  # KV: 1 s
    lk.submit(200, now=0.0, traffic=Traffic.MODEL)
    lk.advance(0.5)
    s = lk.stats()
    # Model traffic went first (0.2 s), then 0.3 s of KV; the chunk on the wire at 0.5 has crossed.
    assert s.bytes_carried == {"model": 200, "kv": 300} and s.bytes_queued == {"model": 0, "kv": 700}
    assert s.queued_bytes == 700 and s.busy_s == pytest.approx(0.5)
    lk.advance(0.55)  # mid-chunk: half of the chunk on the wire still counts as queued
    s = lk.stats()
    assert s.bytes_carried["kv"] == 350 and s.bytes_queued["kv"] == 650
    lk.advance(5.0)
    s = lk.stats()
    assert s.bytes_queued == {"model": 0, "kv": 0} and s.busy_s == pytest.approx(1.2) and s.transfers_done == 2


def test_the_link_refuses_time_going_back_and_negative_bytes() -> None:
    lk = link()
    lk.advance(2.0)
    with pytest.raises(ValueError, match="time went back"):
        lk.advance(1.0)
    with pytest.raises(ValueError):
        lk.submit(-1, now=2.0)
    with pytest.raises(ValueError):
        Link("x", RATE, kv_share=0.9)  # more than half to KV would turn priority upside down


class VirtualClock:
    """Virtual time for threads: a sleeper waits until the driver moves time to its wake-up."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cond = threading.Condition()
        self.wakeups: list[float] = []

    def __call__(self) -> float:
        with self.cond:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self.cond:
            target = self.now + seconds
            self.wakeups.append(target)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.now >= target)
            self.wakeups.remove(target)

    def drive(self, threads: list[threading.Thread]) -> None:
        """Whenever every live thread sleeps, jump to the earliest wake-up."""
        while any(t.is_alive() for t in threads):
            with self.cond:
                if self.wakeups and len(self.wakeups) == sum(t.is_alive() for t in threads):
                    self.now = min(self.wakeups)
                    self.cond.notify_all()
                else:
                    self.cond.wait(0.005)


def test_a_blocking_transfer_waits_its_bytes_in_virtual_time() -> None:
    clock = VirtualClock()
    throttled = ThrottledLink(link(), clock, lambda s: setattr(clock, "now", clock.now + s))
    assert throttled.transfer(250) == pytest.approx(0.25)
    assert throttled.transfer(0) == 0.0
    assert clock.now == pytest.approx(0.25) and throttled.stats().bytes_carried["kv"] == 250


def test_threads_model_transfer_goes_before_a_kv_transfer_already_waiting() -> None:
    clock = VirtualClock()
    throttled = ThrottledLink(link(), clock, clock.sleep)
    done: dict[str, float] = {}

    def transfer(name: str, nbytes: int, traffic: Traffic) -> None:
        throttled.transfer(nbytes, traffic)
        done[name] = clock()

    kv = threading.Thread(target=transfer, args=("kv", 10 * CHUNK, Traffic.KV))
    kv.start()
    with clock.cond:
        clock.cond.wait_for(lambda: len(clock.wakeups) == 1, timeout=5)
        clock.now = 0.5 * CT  # the KV transfer is on the wire when the model transfer comes
    model = threading.Thread(target=transfer, args=("model", CHUNK, Traffic.MODEL))
    model.start()
    clock.drive([kv, model])
    assert done["model"] == pytest.approx(2 * CT) and done["kv"] == pytest.approx(11 * CT)


def test_instance_links_follow_the_flags() -> None:
    links = instance_links(ClusterConfig(storage_gbps=8.0), clock=lambda: 0.0, sleep=lambda s: None)
    assert links.net is None and links.storage is not None
    assert links.storage.link.bytes_per_s == gbps_to_bytes_per_s(8.0) == 1e9
    assert [s.name for s in links.stats()] == ["storage"]


def test_link_counters_render_as_prometheus_series_per_instance_link_and_class() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from boundless.api.metrics import link_metrics

    lk = link()
    lk.submit(1000, now=0.0)
    lk.advance(0.4)

    class Links:
        def collect(self):  # the prometheus_client collector protocol
            return link_metrics({"pe0": [lk.stats()]})

    registry = CollectorRegistry()
    registry.register(Links())
    text = generate_latest(registry).decode()
    assert 'boundless_link_bytes_total{instance="pe0",link="storage",traffic="kv"} 400.0' in text
    assert 'boundless_link_queued_bytes{instance="pe0",link="storage",traffic="kv"} 600.0' in text
    assert 'boundless_link_busy_seconds_total{instance="pe0",link="storage"} 0.4' in text
