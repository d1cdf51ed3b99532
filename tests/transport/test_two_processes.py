"""Two real processes exchanging messages over each transport: bit-exact round trips of odd sizes in bf16
and fp32, KV blocks from one cache into another's at other block ids, a receive that times out (and is not
written by its late message), and a peer that dies.

One peer process per transport (``peer_worker.py``) runs the other side of all three tests, in order."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cases import BACK_BLOCKS, CASES, KV_DTYPES, SENT_BLOCKS, kv_cache, late, make

from boundless.transport.base import KVTransport, PeerGone, TransferTimeout
from boundless.transport.blocks import BlocksReceive, send_blocks
from boundless.transport.endpoints import EndpointSpec, TransportUnavailable, exchange_addresses, open_endpoint

WORKER = Path(__file__).with_name("peer_worker.py")
REPO = Path(__file__).resolve().parents[2]
OPTIONAL = {"nixl": "nixl", "mooncake": "mooncake.engine"}


def _available(kind: str) -> str | None:
    """Why ``kind`` cannot run here, or None."""
    module = OPTIONAL.get(kind)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # a missing package, or a library it needs (libibverbs for Mooncake)
        return f"{module} not importable: {e}"
    return None


class Pair:
    def __init__(self, transport: KVTransport, peer: str, proc: subprocess.Popen) -> None:
        self.transport, self.peer, self.proc = transport, peer, proc


@pytest.fixture(scope="module", params=["gloo", "shm", "nixl", "mooncake"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    kind = request.param
    why = _available(kind)
    if why:
        pytest.skip(why)
    directory = tmp_path_factory.mktemp(f"rendezvous-{kind}")
    if kind == "shm" and Path("/dev/shm").is_dir():
        directory = Path(f"/dev/shm/boundless-test-{os.getpid()}-{kind}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), kind, str(directory)], env=env, stderr=subprocess.PIPE, text=True
    )
    spec = EndpointSpec(kind, str(directory), rank=0, world_size=2, timeout_s=20.0)
    try:
        transport = open_endpoint(spec)
    except TransportUnavailable as e:
        proc.kill()
        pytest.skip(str(e))
    peer = exchange_addresses(spec, transport)[1]
    yield Pair(transport, peer, proc)
    proc.kill()
    proc.wait()
    transport.close()
    shutil.rmtree(directory, ignore_errors=True)


def test_round_trips_are_bit_exact(pair: Pair) -> None:
    t, peer = pair.transport, pair.peer
    for i, case in enumerate(CASES):
        sent = make(case, seed=i)
        back = [torch.zeros_like(x) for x in sent]
        receiving = t.recv(peer, 200 + i, back)
        t.send(peer, 100 + i, sent).wait()
        receiving.wait()
        for a, b in zip(sent, back, strict=True):
            assert a.dtype == b.dtype
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"case {i} came back changed"


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_kv_blocks_move_between_the_two_caches_bit_exact(pair: Pair, dtype: torch.dtype) -> None:
    t, peer = pair.transport, pair.peer
    j = KV_DTYPES.index(dtype)
    mine = kv_cache(dtype, seed=10 + j)
    before = mine.data.clone()
    back = BlocksReceive(t, peer, 610 + j, mine, BACK_BLOCKS)
    send_blocks(t, peer, 600 + j, mine, SENT_BLOCKS).wait()
    back.wait()
    assert torch.equal(mine.read_blocks(BACK_BLOCKS).view(torch.uint8), before[:, :, :, SENT_BLOCKS].view(torch.uint8))
    others = [b for b in range(mine.num_blocks) if b not in BACK_BLOCKS]
    nothing_else = before[:, :, :, others].view(torch.uint8)
    assert torch.equal(mine.read_blocks(others).view(torch.uint8), nothing_else)  # nothing else written


def test_a_receive_times_out_and_its_late_message_writes_nothing(pair: Pair) -> None:
    t, peer = pair.transport, pair.peer
    early = torch.zeros(50_000, dtype=torch.float32)
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        t.recv(peer, 301, early).wait(timeout_s=0.3)
    assert time.monotonic() - start < 5
    nxt = torch.zeros(50_000, dtype=torch.float32)
    receiving = t.recv(peer, 302, nxt)
    t.send(peer, 300, torch.ones(1, dtype=torch.int64)).wait()
    receiving.wait()
    assert torch.equal(nxt, late(302))
    assert not early.any(), "the abandoned receive's tensor was written"


def test_a_dead_peer_is_reported_not_waited_for(pair: Pair) -> None:
    t, peer = pair.transport, pair.peer
    t.send(peer, 400, torch.ones(1, dtype=torch.int64)).wait()
    pair.proc.wait(timeout=20)  # it exits without closing anything
    start = time.monotonic()
    with pytest.raises((PeerGone, TransferTimeout)) as info:
        t.recv(peer, 500, torch.zeros(3)).wait(timeout_s=3)
    assert time.monotonic() - start < 3 or info.type is TransferTimeout
    if pair.transport.kind in ("torch-gloo", "shm"):
        assert info.type is PeerGone  # these two see the closed connection, well before the timeout
