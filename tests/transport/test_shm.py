"""Shared memory, two endpoints in one process (the two-process tests cover processes): tags that do not
wait for each other, a message before its receive, the slot growing, sizes that do not match, a peer that
was never there or has closed, and one restarted at its address."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from boundless.transport.base import PeerGone, TransferTimeout, TransportError
from boundless.transport.shm import ShmTransport


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[ShmTransport, ShmTransport]]:
    # (A test's name alone is the same in another run on this machine, whose endpoints these would take over.)
    name = f"boundless-test-{os.getpid()}-{tmp_path.name}"
    directory = Path("/dev/shm") / name if Path("/dev/shm").is_dir() else tmp_path
    a, b = ShmTransport(directory, "a", timeout_s=5), ShmTransport(directory, "b", timeout_s=5)
    yield a, b
    a.close()
    b.close()
    shutil.rmtree(directory, ignore_errors=True)


def test_tags_do_not_wait_for_each_other_and_early_messages_wait(two: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = two
    big = torch.randn(500_000)  # through the slot
    small = torch.arange(10, dtype=torch.bfloat16)  # inline
    sends = [a.send(b.address, 1, big), a.send(b.address, 2, small)]
    got_small = torch.zeros_like(small)
    b.recv(a.address, 2, got_small).wait()  # tag 2 first: tag 1's message is held meanwhile
    got_big = torch.zeros_like(big)
    b.recv(a.address, 1, got_big).wait()
    for s in sends:
        s.wait()
    assert torch.equal(got_small, small) and torch.equal(got_big, big)


def test_the_slot_grows_and_messages_keep_their_order(two: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = two
    msgs = [torch.full((n,), float(i)) for i, n in enumerate([300_000, 1_000_001, 70_000, 3_000_000])]
    sends = [a.send(b.address, 5, m) for m in msgs]
    for m in msgs:
        out = torch.empty_like(m)
        b.recv(a.address, 5, out).wait()
        assert torch.equal(out, m)
    for s in sends:
        s.wait()


def test_a_message_into_tensors_of_another_size_fails_that_receive(two: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = two
    a.send(b.address, 3, torch.zeros(10)).wait()
    with pytest.raises(TransportError, match="40 bytes into tensors of 36"):
        b.recv(a.address, 3, torch.zeros(9)).wait()


def test_a_peer_never_there_or_closed_is_gone(two: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = two
    with pytest.raises(PeerGone):
        a.send(str(Path(a.address).with_name("nobody")), 1, torch.zeros(1)).wait()
    a.send(b.address, 1, torch.zeros(1)).wait()
    b.close()
    with pytest.raises(PeerGone):
        a.recv(b.address, 2, torch.zeros(1)).wait(timeout_s=3)


def test_a_peer_restarted_at_its_address_is_connected_to_again(two: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = two
    a.send(b.address, 1, torch.zeros(1)).wait()
    b.close()  # as a lost instance's endpoint: a sees it gone
    with pytest.raises(PeerGone):
        a.recv(b.address, 2, torch.zeros(1)).wait(timeout_s=3)
    again = ShmTransport(Path(b.address).parent, "b", timeout_s=5)  # its restart, at the same address
    try:
        sent = torch.arange(4.0)
        a.send(again.address, 3, sent).wait(timeout_s=3)
        got = torch.zeros(4)
        again.recv(a.address, 3, got).wait(timeout_s=3)
        assert torch.equal(got, sent)
    finally:
        again.close()


def test_a_receiver_sleeps_until_a_delivery_and_wakes_for_it(two: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = two
    got = torch.zeros(100_000)
    handle = b.recv(a.address, 3, got)
    seen = b.deliveries
    woke = threading.Event()

    def receiver() -> None:
        b.wait_delivery(seen, timeout_s=30.0)
        woke.set()

    thread = threading.Thread(target=receiver)
    thread.start()
    assert not woke.wait(0.2)  # nothing has come: it sleeps
    sent = torch.randn(100_000)
    a.send(b.address, 3, sent).wait()
    assert woke.wait(10.0)  # woken by the delivery, long before its timeout
    thread.join()
    assert handle.done() and torch.equal(got, sent) and b.deliveries == seen + 1
    # A delivery before the wait (after ``seen`` was read) is not missed: the wait returns at once.
    seen = b.deliveries
    late = b.recv(a.address, 4, torch.zeros(3))
    a.send(b.address, 4, torch.ones(3)).wait()
    late.wait(10.0)
    woke.clear()
    thread = threading.Thread(target=receiver)
    thread.start()
    assert woke.wait(10.0)
    thread.join()


def test_a_slot_mapped_in_inference_mode_carries_messages_outside_it(two: tuple[ShmTransport, ShmTransport]) -> None:
    # The engine's forward pass runs in inference mode (a creditor's partials, a layerwise push); its moves of KV
    # blocks run outside it. A slot mapped there was an inference tensor, and the next copy into it outside raised.
    a, b = two
    first, second = torch.randn(300_000), torch.randn(300_000)  # each through the slot
    with torch.inference_mode():
        send = a.send(b.address, 1, first)
        got = torch.empty_like(first)
        b.recv(a.address, 1, got).wait()
        send.wait()
    assert torch.equal(got, first)
    send = a.send(b.address, 2, second)
    got = torch.empty_like(second)
    b.recv(a.address, 2, got).wait()
    send.wait()
    assert torch.equal(got, second)


def test_a_receive_given_up_lets_go_of_its_tensors_and_swallows_its_late_message(
    two: tuple[ShmTransport, ShmTransport],
) -> None:
    # Before, a receive that timed out kept its tensors until its message came: never, for a KV lending move whose
    # debtor gave it up (its staging tensor, 0.7 MB a block, held for as long as the endpoint lived).
    a, b = two
    handle = b.recv(a.address, 9, torch.zeros(100_000))
    with pytest.raises(TransferTimeout):
        handle.wait(0.05)
    # (The receive's views of the tensors, not the tensor objects, are what held their memory.)
    waiting = [posting.target for line in b._matcher._posted.values() for posting in line]
    assert len(waiting) == 1 and waiting[0].views == []
    late, following = torch.ones(100_000), torch.full((10,), 2.0)
    sends = [a.send(b.address, 9, late), a.send(b.address, 9, following)]
    got = torch.zeros(10)
    b.recv(a.address, 9, got).wait()  # the late message went to the receive given up, not to this one
    for s in sends:
        s.wait()
    assert torch.equal(got, following)
