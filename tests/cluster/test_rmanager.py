"""The rManager's ledger and the try/move protocol, path by path, with the transport played by hand: every
message is delivered (or dropped, or delayed) explicitly, on a clock moved by hand."""

from __future__ import annotations

import pytest

from boundless.cluster.rmanager import (
    FreeLentBlocks,
    FreeLocalBlocks,
    LendingAction,
    LoanState,
    LocalRequest,
    LocalState,
    MoveRejected,
    Recompute,
    ReleaseRemote,
    RManager,
    SendBlocks,
    TryMove,
)

TIMEOUT_S = 2.0
BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def pair(creditor_blocks: int = 32, headroom: int = 0) -> tuple[RManager, RManager, Clock]:
    """A debtor "A" running request "long" (20 blocks, 310 tokens) and a creditor "B" with 4 blocks of its own."""
    clock = Clock()
    debtor = RManager("A", 24, BLOCK, clock, TIMEOUT_S)
    creditor = RManager("B", creditor_blocks, BLOCK, clock, TIMEOUT_S, headroom_blocks=headroom)
    debtor.observe(LocalState(own_blocks=24, batch_size=1, max_batch_size=8, requests={"long": LocalRequest(310, 20)}))
    creditor.observe(LocalState(own_blocks=4, batch_size=2, max_batch_size=8))
    return debtor, creditor, clock


def one(actions: list[LendingAction], kind: type) -> LendingAction:
    assert len(actions) == 1 and isinstance(actions[0], kind), actions
    return actions[0]


def deliver_try(debtor: RManager, creditor: RManager, try_move: TryMove) -> list[LendingAction]:
    accepted = creditor.try_move_kvcache(try_move.move_id, try_move.request_id, try_move.debtor, try_move.num_blocks)
    return debtor.try_answered(try_move.move_id, creditor.instance_id, accepted)


def deliver_blocks(debtor: RManager, creditor: RManager, send: SendBlocks, first_id: int = 100) -> list[LendingAction]:
    """The creditor writes the blocks into pool blocks of its own and answers."""
    ids = list(range(first_id, first_id + send.num_blocks))
    return debtor.move_done(send.move_id, creditor.instance_id, creditor.receive_blocks(send.move_id, ids))


def test_a_move_reserves_then_moves_and_the_debtor_frees_its_copies_only_on_confirmation() -> None:
    debtor, creditor, _ = pair()
    try_move = one(debtor.move_kvcache("long", 8, "B"), TryMove)
    assert (try_move.creditor, try_move.debtor, try_move.num_blocks) == ("B", "A", 8)
    send = one(deliver_try(debtor, creditor, try_move), SendBlocks)
    assert (send.first_block, send.num_blocks) == (0, 8)  # the request's leading blocks
    assert creditor.reserved_blocks == 8 and creditor.free_blocks == 32 - 4 - 8
    assert debtor.remote_spans("long") == []  # still local: nothing confirmed yet
    free = one(deliver_blocks(debtor, creditor, send), FreeLocalBlocks)
    assert free == FreeLocalBlocks("long", 0, 8)
    assert creditor.lent_blocks == 8 and creditor.reserved_blocks == 0
    assert creditor.loans[send.move_id].block_ids == tuple(range(100, 108))
    [span] = debtor.remote_spans("long")
    assert (span.creditor, span.first_block, span.num_blocks) == ("B", 0, 8)
    beat = debtor.heartbeat()
    [report] = beat.requests
    assert (report.local_blocks, report.remote, report.movable_blocks) == (12, (("B", 8),), 11)
    assert beat.instance.borrowed_blocks == 8 and beat.instance.free_blocks == 8
    assert beat.instance.context_tokens == 310 - 8 * BLOCK
    lender = creditor.heartbeat().instance
    assert (lender.lent_blocks, lender.context_tokens) == (8, 8 * BLOCK)  # the debtor's attention runs here
    assert debtor.counters.moves_committed == 1 and debtor.counters.blocks_moved_out == 8


def test_a_second_move_takes_the_next_blocks_and_never_the_one_being_written() -> None:
    debtor, creditor, _ = pair(creditor_blocks=64)
    for _ in range(2):
        send = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
        deliver_blocks(debtor, creditor, send)
    assert [(s.first_block, s.num_blocks) for s in debtor.remote_spans("long")] == [(0, 8), (8, 8)]
    last = one(debtor.move_kvcache("long", 100, "B"), TryMove)  # asks for more than is movable
    assert last.num_blocks == 3  # blocks 16..18; block 19 takes the new tokens


def test_moves_of_one_request_to_two_creditors_take_disjoint_blocks() -> None:
    debtor, creditor, clock = pair()
    other = RManager("C", 32, BLOCK, clock, TIMEOUT_S)
    to_b = one(debtor.move_kvcache("long", 5, "B"), TryMove)
    to_c = one(debtor.move_kvcache("long", 5, "C"), TryMove)
    send_b = one(deliver_try(debtor, creditor, to_b), SendBlocks)
    send_c = one(deliver_try(debtor, other, to_c), SendBlocks)
    assert (send_b.first_block, send_c.first_block) == (0, 5)
    deliver_blocks(debtor, other, send_c)
    deliver_blocks(debtor, creditor, send_b)
    assert sorted((s.creditor, s.first_block) for s in debtor.remote_spans("long")) == [("B", 0), ("C", 5)]


def test_a_creditor_without_room_refuses_and_the_debtor_keeps_everything() -> None:
    debtor, creditor, _ = pair(creditor_blocks=16, headroom=4)  # 12 free, 4 of them kept for its own requests
    try_move = one(debtor.move_kvcache("long", 9, "B"), TryMove)
    assert deliver_try(debtor, creditor, try_move) == []
    assert creditor.loans == {} and debtor.pending == {} and debtor.remote_spans("long") == []
    assert debtor.counters.moves_refused == 1
    assert creditor.try_move_kvcache("x/1", "r", "X", 8)  # within the room left: first come, first served
    assert not creditor.try_move_kvcache("x/2", "r", "X", 1)


def test_reservations_are_first_come_first_served() -> None:
    clock = Clock()
    creditor = RManager("B", 20, BLOCK, clock, TIMEOUT_S)
    assert creditor.try_move_kvcache("A/0", "a", "A", 12)
    assert not creditor.try_move_kvcache("C/0", "c", "C", 12)  # the gManager's view was stale: refused
    assert creditor.try_move_kvcache("C/1", "c", "C", 8)


def test_a_reservation_nobody_fills_expires_and_late_blocks_are_refused() -> None:
    debtor, creditor, clock = pair()
    send = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    clock.now += TIMEOUT_S  # the debtor stalls between the try and the move
    creditor.expire()
    assert creditor.loans == {} and creditor.free_blocks == 28 and creditor.counters.reservations_expired == 1
    # The blocks arrive late: refused, so the creditor's engine frees what it wrote and the debtor keeps its own.
    assert one(deliver_blocks(debtor, creditor, send), ReleaseRemote) == ReleaseRemote("B", send.move_id)
    assert creditor.loans == {} and debtor.remote_spans("long") == [] and debtor.pending == {}
    assert debtor.heartbeat().requests[0].local_blocks == 20
    assert creditor.release(send.move_id) == []  # the release finds nothing: idempotent


def test_a_debtor_gives_up_a_move_without_an_answer_and_a_late_yes_is_released() -> None:
    debtor, creditor, clock = pair()
    try_move = one(debtor.move_kvcache("long", 8, "B"), TryMove)
    clock.now += TIMEOUT_S
    assert debtor.expire() == [ReleaseRemote("B", try_move.move_id)]
    assert debtor.pending == {} and debtor.heartbeat().requests[0].movable_blocks == 19
    # The try was only delayed: the creditor reserves, the debtor answers the yes with a release.
    release = one(deliver_try(debtor, creditor, try_move), ReleaseRemote)
    assert creditor.release(release.move_id) == [] and creditor.loans == {}


def test_a_lost_debtor_has_its_creditor_free_what_it_held_and_promised() -> None:
    debtor, creditor, _ = pair(creditor_blocks=64)
    send = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    deliver_blocks(debtor, creditor, send)
    pending = one(debtor.move_kvcache("long", 4, "B"), TryMove)
    deliver_try(debtor, creditor, pending)  # reserved; then the debtor dies
    assert creditor.lent_blocks == 8 and creditor.reserved_blocks == 4
    freed = creditor.peer_lost("A")
    assert freed == [FreeLentBlocks("A", send.move_id, tuple(range(100, 108)))]
    assert creditor.loans == {} and creditor.free_blocks == 60
    assert not creditor.try_move_kvcache("A/9", "long", "A", 1)  # nothing more is taken from a lost debtor


def test_a_lost_creditor_has_the_debtor_recompute_its_blocks_and_keep_those_in_flight() -> None:
    debtor, creditor, _ = pair(creditor_blocks=64)
    send = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    deliver_blocks(debtor, creditor, send)
    in_flight = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 4, "B"), TryMove)), SendBlocks)
    assert debtor.peer_lost("B") == [Recompute("long", 0, 8)]
    assert debtor.remote_spans("long") == [] and debtor.pending == {}
    report = debtor.heartbeat().requests[0]
    assert (report.local_blocks, report.remote) == (20, ())  # blocks 8..11 never left; 0..7 come back
    assert debtor.move_done(in_flight.move_id, "B", False) == [ReleaseRemote("B", in_flight.move_id)]
    assert one(debtor.move_kvcache("long", 4, "B"), MoveRejected).reason == "instance B is lost"
    assert debtor.counters.blocks_recomputed == 8


def test_a_lost_peer_started_again_lends_and_borrows_again_from_nothing() -> None:
    debtor, creditor, _ = pair(creditor_blocks=64)
    send = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    deliver_blocks(debtor, creditor, send)
    debtor.peer_lost("B")
    creditor.peer_lost("A")  # each saw the other go (one of them was restarted; neither knows which)
    debtor.peer_back("B")
    creditor.peer_back("A")
    assert debtor.remote_spans("long") == [] and creditor.loans == {}  # nothing of before comes back
    again = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 4, "B"), TryMove)), SendBlocks)
    assert deliver_blocks(debtor, creditor, again, first_id=200) == [FreeLocalBlocks("long", 0, 4)]
    assert creditor.lent_blocks == 4 and [s.num_blocks for s in debtor.remote_spans("long")] == [4]


def test_a_request_that_finishes_mid_move_leaves_nothing_held_for_it() -> None:
    debtor, creditor, _ = pair(creditor_blocks=64)
    committed = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    deliver_blocks(debtor, creditor, committed)
    sending = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 4, "B"), TryMove)), SendBlocks)
    trying = one(debtor.move_kvcache("long", 2, "B"), TryMove)
    releases = debtor.request_finished("long")
    assert sorted(releases, key=str) == sorted(
        [ReleaseRemote("B", m) for m in (committed.move_id, sending.move_id, trying.move_id)], key=str
    )
    freed = [a for r in releases for a in creditor.release(r.move_id)]  # the releases reach the creditor
    assert freed == [FreeLentBlocks("A", committed.move_id, tuple(range(100, 108)))]
    # The messages that crossed the releases: the try lands after them, the blocks after that.
    late_yes = one(deliver_try(debtor, creditor, trying), ReleaseRemote)
    creditor.release(late_yes.move_id)
    assert one(deliver_blocks(debtor, creditor, sending), ReleaseRemote).move_id == sending.move_id
    assert creditor.loans == {} and creditor.free_blocks == 60
    assert debtor.pending == {} and debtor.spans == {} and debtor.heartbeat().requests == ()


def test_blocks_confirmed_after_the_request_finished_are_released() -> None:
    debtor, creditor, _ = pair()
    send = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    [release] = debtor.request_finished("long")
    accepted = creditor.receive_blocks(send.move_id, list(range(8)))  # the data was on its way: it lands
    assert accepted and creditor.loans[send.move_id].state is LoanState.FILLED
    assert debtor.move_done(send.move_id, "B", accepted) == [ReleaseRemote("B", send.move_id)]
    assert creditor.release(release.move_id) == [FreeLentBlocks("A", send.move_id, tuple(range(8)))]
    assert creditor.release(send.move_id) == []  # the second release finds nothing


def test_a_repeated_confirmation_changes_nothing() -> None:
    debtor, creditor, _ = pair()
    send = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    deliver_blocks(debtor, creditor, send)
    assert debtor.move_done(send.move_id, "B", True) == []
    assert debtor.move_done(send.move_id, "B", False) == []  # a late failure report about a committed move
    assert creditor.lent_blocks == 8 and len(debtor.remote_spans("long")) == 1


@pytest.mark.parametrize(
    ("request_id", "num_blocks", "creditor", "reason"),
    [
        ("long", 4, "A", "a request's blocks cannot be lent to its own instance"),
        ("gone", 4, "B", "not a running request here"),
        ("long", 0, "B", "nothing to move"),
    ],
)
def test_moves_that_cannot_start_are_rejected(request_id: str, num_blocks: int, creditor: str, reason: str) -> None:
    debtor, _, _ = pair()
    assert one(debtor.move_kvcache(request_id, num_blocks, creditor), MoveRejected).reason == reason
    assert debtor.pending == {} and debtor.counters.moves_started == 0


def test_a_request_of_one_block_has_nothing_to_move() -> None:
    debtor, _, _ = pair()
    debtor.observe(LocalState(1, 1, 8, {"short": LocalRequest(5, 1)}))
    assert one(debtor.move_kvcache("short", 1, "B"), MoveRejected).reason == "no movable blocks"


def test_what_a_creditor_lends_is_not_its_requests_to_use() -> None:
    _, creditor, _ = pair()
    assert creditor.own_capacity == 32
    assert creditor.try_move_kvcache("A/0", "long", "A", 6)
    assert creditor.receive_blocks("A/0", list(range(6)))
    assert creditor.try_move_kvcache("A/1", "long", "A", 2)
    assert creditor.own_capacity == 32 - 8 and creditor.free_blocks == 32 - 4 - 8


def test_moves_cancelled_before_a_preemption_leave_the_moved_blocks_where_they_are() -> None:
    debtor, creditor, _ = pair(creditor_blocks=64)
    committed = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 8, "B"), TryMove)), SendBlocks)
    deliver_blocks(debtor, creditor, committed)
    sending = one(deliver_try(debtor, creditor, one(debtor.move_kvcache("long", 4, "B"), TryMove)), SendBlocks)
    assert debtor.cancel_moves("long") == [ReleaseRemote("B", sending.move_id)]
    assert creditor.release(sending.move_id) == []  # only reserved: nothing to free
    assert [s.move_id for s in debtor.remote_spans("long")] == [committed.move_id]
    assert creditor.lent_blocks == 8 and creditor.reserved_blocks == 0
    # Blocks already on their way arrive after the release: refused, and the debtor is told to release again.
    assert one(deliver_blocks(debtor, creditor, sending), ReleaseRemote).move_id == sending.move_id
