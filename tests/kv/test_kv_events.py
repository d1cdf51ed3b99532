"""KV cache events as vLLM publishes them (``--kv-events-config``): a real engine with events on, a real ZMQ SUB socket
on 127.0.0.1 decoding vLLM's wire form with msgpack, the replay socket, and one served through the HTTP server."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import openai
import pytest
import zmq

from boundless.api.launch import start_in_thread
from boundless.config import CacheConfig, ConfigError, EngineConfig, KVEventsConfig, ModelConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.block_hash import extend_block_hashes
from boundless.kv.event_publisher import ZmqEventPublisher, offset_endpoint
from boundless.kv.event_wire import external_hash
from boundless.kv.events import AllBlocksCleared
from boundless.model.loader import LoadedModel
from boundless.model.lora import LoRARequest
from boundless.model.random_model import write_random_lora

BS = 16
PROMPT = [(7 * j) % 300 + 3 for j in range(5 * BS)]  # five full blocks
OTHER = [(11 * j) % 290 + 5 for j in range(5 * BS)]
WAIT_MS = 5000  # the most a receive waits (a batch comes within milliseconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Batch:
    seq: int
    ts: float
    events: list
    rank: int
    payload: bytes


class Subscriber:
    """A SUB socket on 127.0.0.1 that binds (the engine's publisher connects to it, vLLM's rule for an address without
    a wildcard), and a DEALER for the replay socket."""

    def __init__(self, topic: str = "kv") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = _free_port()
        self.topic = topic

    def config(self, **extra: object) -> str:
        return json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://127.0.0.1:{self.port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
                "topic": self.topic,
                **extra,
            }
        )

    def receive(self) -> Batch:
        assert self.sub.poll(WAIT_MS), "no batch came"
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic.encode()
        ts, events, rank = msgpack.unpackb(payload)
        return Batch(int.from_bytes(seq, "big"), ts, events, rank, payload)

    def drain(self) -> list[Batch]:
        out = []
        while self.sub.poll(200):
            out.append(self.receive())
        return out

    def replay(self, start: int, with_topic: bool = True) -> list[tuple[int, bytes]]:
        """The batches the replay socket resends from ``start``, read as vLLM 0.26 on sends them (its PR 45177:
        ``[topic, seq, payload]`` after the envelope, as on the PUB socket; the end ``[b"", -1, b""]``), or, without
        ``with_topic``, as vLLM 0.23 did (``[seq, payload]``, the end ``[-1, b""]``)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(WAIT_MS), "the replay did not end"
            frames = dealer.recv_multipart()
            if with_topic:
                empty, topic, seq, payload = frames
            else:
                (empty, seq, payload), topic = frames, None
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b"" and topic in (b"", None)
                break
            assert topic in (self.topic.encode(), None)
            out.append((int.from_bytes(seq, "big"), payload))
        dealer.close(0)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # every socket, a replay's DEALER that a failed assertion left open too


@pytest.fixture
def sub() -> Iterator[Subscriber]:
    s = Subscriber()
    yield s
    s.close()


def _engine(
    loaded: LoadedModel, kv_events: str | None, num_blocks: int = 64, host_gb: float = 0.0, lora: bool = False
) -> EngineCore:
    cache = CacheConfig(num_kv_blocks=num_blocks, kv_host_gb=host_gb, kv_events_config=kv_events)
    model = ModelConfig(max_model_len=min(512, num_blocks * BS), enable_lora=lora)
    return EngineCore.from_model(loaded, EngineConfig(model=model, cache=cache))


def _connected(core: EngineCore, sub: Subscriber) -> int:
    """Reset the prefix cache until the subscriber hears it (a connection's subscription takes a moment to reach the
    publisher: what is sent before it is not delivered); the last sequence number heard."""
    for _ in range(100):
        core.reset_prefix_cache()
        if sub.sub.poll(50):
            batch = sub.receive()
            assert batch.events in ([{"type": "AllBlocksCleared"}], [["AllBlocksCleared"]])
            for late in sub.drain():  # resets sent while the first was on its way
                assert late.seq == batch.seq + 1 and late.events == batch.events
                batch = late
            return batch.seq
    raise AssertionError("the subscriber never heard the publisher")


def _run(core: EngineCore, rid: str, prompt: list[int], lora: str | None = None) -> None:
    core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, lora_name=lora))
    while core.has_unfinished():
        core.step()


def _events(batches: list[Batch], after: int) -> list[dict]:
    """The batches' events, checking that their numbers run on from ``after`` without a gap."""
    assert [b.seq for b in batches] == list(range(after + 1, after + 1 + len(batches)))
    return [e for b in batches for e in b.events]


def _names(core: EngineCore, prompt: list[int]) -> list[int]:
    return [external_hash(h) for h in extend_block_hashes([], prompt, BS, core.identity.fingerprint)]


def test_a_prompts_blocks_are_stored_and_a_shared_prefix_stores_only_its_new_blocks(
    tiny_llama: LoadedModel, sub: Subscriber
) -> None:
    core = _engine(tiny_llama, sub.config())
    try:
        last = _connected(core, sub)
        _run(core, "a", PROMPT)
        batches = sub.drain()
        events = _events(batches, last)
        names = _names(core, PROMPT)
        assert events == [
            {
                "type": "BlockStored",
                "block_hashes": names,
                "parent_block_hash": None,
                "token_ids": PROMPT,
                "block_size": BS,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ]
        assert all(b.rank == 0 and isinstance(b.ts, float) for b in batches)
        # Four blocks shared, two new: only the new ones are stored, chained to the last shared one.
        second = PROMPT[: 4 * BS] + OTHER[: 2 * BS]
        _run(core, "b", second)
        stored = _events(sub.drain(), batches[-1].seq)
        new = _names(core, second)
        assert new[:4] == names[:4]
        assert [(e["type"], e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in stored] == [
            ("BlockStored", new[4:], names[3], second[4 * BS :])
        ]
    finally:
        core.close()


def test_an_adapters_blocks_say_its_id_and_name(tiny_llama: LoadedModel, sub: Subscriber, tmp_path: Path) -> None:
    core = _engine(tiny_llama, sub.config(), lora=True)
    core.add_lora(LoRARequest("sql", 7, str(write_random_lora(tmp_path / "sql", tiny_llama.arch))))
    try:
        last = _connected(core, sub)
        _run(core, "a", PROMPT, lora="sql")
        (event,) = _events(sub.drain(), last)
        namespace = core.kv_namespace(SamplingParams(lora_name="sql"))
        assert namespace is not None
        names = [external_hash(h) for h in extend_block_hashes([], PROMPT, BS, namespace)]
        assert (event["lora_id"], event["lora_name"], event["block_hashes"]) == (7, "sql", names)
        assert names != _names(core, PROMPT)  # the adapter's KV is not the base model's
    finally:
        core.close()


def test_eviction_removes_blocks_and_demotion_stores_them_in_host_memory(
    tiny_llama: LoadedModel, sub: Subscriber
) -> None:
    # Device only: a second prompt's blocks evict the first's from a pool of 8 (6 a request).
    core = _engine(tiny_llama, sub.config(), num_blocks=8)
    try:
        last = _connected(core, sub)
        _run(core, "a", PROMPT)
        _run(core, "b", OTHER)
        events = _events(sub.drain(), last)
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert {e["medium"] for e in events if e["type"] == "BlockRemoved"} == {"GPU"}
        assert removed and set(removed) <= set(_names(core, PROMPT))
        # Each removal comes after the block's store and before the new blocks that took its place are stored.
        kinds = [e["type"] for e in events]
        assert kinds[0] == "BlockStored" and kinds.index("BlockRemoved") < len(kinds) - 1
    finally:
        core.close()
    # With host memory: an evicted block leaves the device and is stored below it (names only, as vLLM's CPU tier).
    core = _engine(tiny_llama, sub.config(), num_blocks=8, host_gb=0.01)
    try:
        last = _connected(core, sub)
        _run(core, "a", PROMPT)
        _run(core, "b", OTHER)
        events = _events(sub.drain(), last)
        gone = [h for e in events if e["type"] == "BlockRemoved" and e["medium"] == "GPU" for h in e["block_hashes"]]
        below = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
        assert gone and [h for e in below for h in e["block_hashes"]] == gone
        assert all(e["parent_block_hash"] is None and e["token_ids"] == [] and e["block_size"] == BS for e in below)
        core.reset_prefix_cache()
        assert [b.events for b in sub.drain()] == [[{"type": "AllBlocksCleared"}]]  # one event for every tier
    finally:
        core.close()


def test_the_replay_socket_resends_from_a_sequence_number(tiny_llama: LoadedModel, sub: Subscriber) -> None:
    core = _engine(tiny_llama, sub.config())
    try:
        last = _connected(core, sub)
        _run(core, "a", PROMPT)
        _run(core, "b", OTHER)
        core.reset_prefix_cache()
        batches = sub.drain()
        _events(batches, last)
        assert len(batches) >= 3
        start = batches[1].seq
        assert sub.replay(start) == [(b.seq, b.payload) for b in batches[1:]]
        assert sub.replay(batches[-1].seq + 1) == []
    finally:
        core.close()


def test_the_replay_says_the_topic_as_vllms_does(tiny_llama: LoadedModel, sub: Subscriber) -> None:
    """vLLM 0.26 on (its PR 45177) resends each batch as the PUB socket sent it, ``[topic, seq, payload]`` after the
    envelope, and ends with ``[b"", -1, b""]``: a router (llm-d's) reads the instance and the model from the topic of
    a replayed batch. ``event_format: array`` answers as vLLM 0.23 did, without the topic."""
    sub.topic = "kv@pod-1@smollm2"
    for event_format, frames in (("map", 4), ("array", 3)):
        core = _engine(tiny_llama, sub.config(event_format=event_format))
        try:
            last = _connected(core, sub)
            _run(core, "a", PROMPT)
            (batch,) = sub.drain()
            assert batch.seq == last + 1
            dealer = sub.ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{sub.replay_port}")
            dealer.send_multipart([b"", batch.seq.to_bytes(8, "big")])
            got = []
            while not got or got[-1][-1]:
                assert dealer.poll(WAIT_MS), "the replay did not end"
                got.append(dealer.recv_multipart())
            dealer.close(0)
            end = (-1).to_bytes(8, "big", signed=True)
            if event_format == "map":
                assert got == [
                    [b"", sub.topic.encode(), batch.seq.to_bytes(8, "big"), batch.payload],
                    [b"", b"", end, b""],
                ]
            else:
                assert got == [[b"", batch.seq.to_bytes(8, "big"), batch.payload], [b"", end, b""]]
            assert {len(m) for m in got} == {frames}
            assert sub.replay(batch.seq, with_topic=event_format == "map") == [(batch.seq, batch.payload)]
        finally:
            core.close()


def test_the_array_format_and_a_ranks_port(tiny_llama: LoadedModel, sub: Subscriber) -> None:
    """``event_format: array`` sends vLLM 0.23's tagged arrays; rank 1 publishes on the port after the endpoint's,
    its batches saying rank 1 (an instance of ``--instances``)."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=512),
        cache=CacheConfig(
            num_kv_blocks=64,
            kv_events_config=json.dumps(
                {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{sub.port - 1}", "topic": "kv"}
                | {"event_format": "array"}
            ),
        ),
    )
    core = EngineCore.from_model(tiny_llama, config, events_rank=1)
    try:
        last = _connected(core, sub)
        _run(core, "a", PROMPT)
        batches = sub.drain()
        assert [b.rank for b in batches] == [1]
        assert _events(batches, last) == [["BlockStored", _names(core, PROMPT), None, PROMPT, BS, None, "GPU", None]]
    finally:
        core.close()


def test_a_full_queue_drops_batches_and_their_numbers_show_the_gap(sub: Subscriber) -> None:
    """The engine never waits for the publisher: past ``max_queue_size`` waiting batches a batch is dropped and
    counted, and its number is skipped, so a subscriber sees what it missed."""
    config = KVEventsConfig.parse(sub.config(max_queue_size=1))
    publisher = ZmqEventPublisher(config, BS)
    try:
        for _ in range(100):  # until the subscription has reached the publisher
            publisher.publish([AllBlocksCleared()])
            if sub.sub.poll(50):
                break
        first, sent = max(b.seq for b in [sub.receive(), *sub.drain()]) + 1, 2000
        for _ in range(sent):
            publisher.publish([AllBlocksCleared()])
        seqs = [b.seq for b in sub.drain()]
        assert publisher.dropped_batches > 0 and len(seqs) + publisher.dropped_batches == sent
        assert seqs == sorted(set(seqs)) and seqs[0] >= first and seqs[-1] < first + sent
    finally:
        publisher.close()


def test_an_engine_that_fails_to_start_lets_its_endpoints_go(
    tiny_llama: LoadedModel, sub: Subscriber, tmp_path: Path
) -> None:
    """An adapter of --lora-modules that does not load fails the start after the publisher bound its replay socket:
    the publisher is closed with it, so the same config, fixed, starts in the same process (as a notebook retries)."""
    cache = CacheConfig(num_kv_blocks=64, kv_events_config=sub.config())
    broken = ModelConfig(max_model_len=512, enable_lora=True, lora_modules=(f"sql={tmp_path}",))
    with pytest.raises(ConfigError, match="lora-modules"):
        EngineCore.from_model(tiny_llama, EngineConfig(model=broken, cache=cache))
    EngineCore.from_model(tiny_llama, EngineConfig(model=ModelConfig(max_model_len=512), cache=cache)).close()


def test_events_off_make_nothing(tiny_llama: LoadedModel) -> None:
    for off in (None, '{"enable_kv_cache_events": false}', '{"enable_kv_cache_events": true, "publisher": "null"}'):
        core = _engine(tiny_llama, off, host_gb=0.01)
        try:
            assert core.kv_events is None and core.kv.events is None
            assert all(pool.events is None for pool in core.kv.pools.values())
        finally:
            core.close()


def test_the_config_is_vllms_and_checked() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "t"}')
    assert (config.publisher, config.endpoint, config.buffer_steps, config.publishes) == (
        "zmq",
        "tcp://*:5557",
        10_000,
        True,
    )
    for bad, said in (
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown keys"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"hwm": 0}', "hwm"),
        ('{"buffer_steps": "x"}', "buffer_steps"),
        ('{"endpoint": "http://x"}', "endpoint"),
        ("[1]", "JSON object"),
    ):
        with pytest.raises(ConfigError, match=said):
            CacheConfig(kv_events_config=bad)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def test_served_requests_publish_their_blocks(tiny_llama: LoadedModel, sub: Subscriber) -> None:
    """``boundless serve --kv-events-config``: the flag, the engine behind the HTTP server, the openai client."""
    from boundless.cli import build_parser
    from boundless.config import engine_config_from_flags

    args = build_parser().parse_args(
        ["serve", "--max-model-len", "512", "--num-kv-blocks", "64", "--kv-events-config", sub.config()]
    )
    engine = AsyncEngine(EngineCore.from_model(tiny_llama, engine_config_from_flags(args)))
    server = start_in_thread(engine, "tiny")
    try:
        last = _connected(engine.core, sub)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
        stored = [e for e in _events(sub.drain(), last) if e["type"] == "BlockStored"]
        assert [h for e in stored for h in e["block_hashes"]] == _names(engine.core, PROMPT)
        assert [t for e in stored for t in e["token_ids"]] == PROMPT
    finally:
        server.stop()
        engine.shutdown()
