"""The pieces every transport shares, without processes: matching receives with messages in order (a
cancelled receive swallows its message), cutting two sides' tensors into common pieces, and the wait's
deadline on an injected clock."""

from __future__ import annotations

import pytest
import torch

from boundless.transport.base import PolledHandle, TransferTimeout, TransportError, as_byte_views, pair_segments
from boundless.transport.matching import Matcher


def test_messages_go_to_receives_in_order_per_peer_and_tag() -> None:
    m: Matcher[str, str] = Matcher()
    first, held = m.post(("a", 1), "recv-1")
    assert held is None
    second, _ = m.post(("a", 1), "recv-2")
    assert m.next_posting(("b", 1)) is None  # another peer's message does not take a's receive
    m.hold(("b", 1), "msg-b")
    assert m.next_posting(("a", 1)) is first
    assert m.next_posting(("a", 1)) is second
    assert m.next_posting(("a", 1)) is None
    _, held = m.post(("b", 1), "recv-b")  # a message that came first is taken at once
    assert held == "msg-b"
    assert m.waiting_messages() == 0


def test_a_cancelled_receive_swallows_its_message_not_the_next_receives() -> None:
    m: Matcher[str, str] = Matcher()
    late, _ = m.post(("a", 7), "timed out")
    m.cancel(late)
    nxt, _ = m.post(("a", 7), "next")
    got = m.next_posting(("a", 7))
    assert got is late and got.cancelled  # the late message is dropped here...
    assert m.next_posting(("a", 7)) is nxt  # ...and the next message reaches the next receive


def test_receives_from_a_peer_gone_are_all_returned_to_fail() -> None:
    m: Matcher[str, str] = Matcher()
    p1, _ = m.post(("a", 1), "x")
    p2, _ = m.post(("a", 2), "y")
    m.post(("b", 1), "z")
    assert {id(p) for p in m.postings_from("a")} == {id(p1), id(p2)}
    assert m.postings_from("a") == []
    assert m.next_posting(("b", 1)) is not None


def test_pieces_cut_where_either_side_ends() -> None:
    local = [(1000, 10), (2000, 5)]
    remote = [(50, 4), (80, 11)]
    assert pair_segments(local, remote) == [(1000, 50, 4), (1004, 80, 6), (2000, 86, 5)]
    with pytest.raises(TransportError, match="15 bytes into tensors of 16"):
        pair_segments([(0, 16)], remote)


def test_byte_views_share_memory_and_refuse_strided_tensors() -> None:
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    (v,) = as_byte_views(x)
    assert v.numel() == 12 and v.data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match="contiguous"):
        as_byte_views(x.t())


def test_a_wait_times_out_on_its_clock_and_cancels_once() -> None:
    now = [0.0]
    cancelled = []

    def clock() -> float:  # each reading takes 10 us (the spin before blocking reads it)
        now[0] += 1e-5
        return now[0]

    def block(seconds: float) -> None:
        now[0] += seconds

    h = PolledHandle(lambda: False, 2.0, "op", cancel=lambda: cancelled.append(1), clock=clock, block=block)
    with pytest.raises(TransferTimeout, match="op: no completion in 2 s"):
        h.wait()
    assert now[0] >= 2.0 and cancelled == [1]
    with pytest.raises(TransferTimeout):
        h.done()  # stays failed
    assert cancelled == [1]


def test_a_gloo_group_whose_peer_never_joins_fails_to_open(tmp_path) -> None:
    from boundless.transport.endpoints import EndpointSpec, open_endpoint

    with pytest.raises(TransferTimeout, match="joining a gloo group of 2 as rank 0"):
        open_endpoint(EndpointSpec("gloo", str(tmp_path), rank=0, world_size=2, timeout_s=0.5))
