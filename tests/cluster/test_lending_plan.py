"""The greedy lending planner (Algorithm 1) on hand-built cluster states, with models fitted from step samples."""

from __future__ import annotations

import pytest
from lending_cases import ATTENTION_BOUND, GPU_LIKE, instance, request, samples_of

from boundless.cluster.lending_plan import (
    LendingThresholds,
    MoveOrder,
    plan_lending,
    request_pools,
    served_request_pools,
)
from boundless.cluster.perf_model import fit_step_time_model
from boundless.config import ClusterConfig, ConfigError
from boundless.engine.attention_time import AttentionTimeModel

THRESHOLDS = LendingThresholds(debtor_max_batch=8, creditor_max_usage=0.6, creditor_headroom=0.1, min_gain=0.01)


@pytest.fixture(scope="module")
def gpu_like() -> AttentionTimeModel:
    return fit_step_time_model(samples_of(GPU_LIKE, noise=0.02))


@pytest.fixture(scope="module")
def attention_bound() -> AttentionTimeModel:
    return fit_step_time_model(samples_of(ATTENTION_BOUND, noise=0.02))


def test_the_papers_figure_5_the_saturated_long_request_borrows_from_the_least_used_instance(
    gpu_like: AttentionTimeModel,
) -> None:
    # A: one long request fills its memory, six short ones wait (4 blocks each). D: a long request with room to
    # spare. B and C: short requests and plenty of room, B the least used.
    reports = [
        instance("A", 64, 63, batch=1, context=1000, waiting=[4] * 6),
        instance("B", 64, 12, batch=3, context=180),
        instance("C", 64, 16, batch=4, context=240),
        instance("D", 64, 48, batch=3, context=760),
    ]
    requests = [request("a-long", "A", 63, 1000), request("b1", "B", 4, 60), request("d-long", "D", 40, 640)]
    plan = plan_lending(reports, requests, gpu_like, THRESHOLDS)
    # Exactly the blocks that admit the six waiting requests (1 free + 23 = 24): more would only move attention.
    assert plan.moves == (MoveOrder("a-long", "A", "B", 23),)
    assert plan.throughput_after > 1.4 * plan.throughput_before  # A runs 7 requests instead of 1


def test_a_request_too_big_for_one_creditor_is_spread_over_the_next(gpu_like: AttentionTimeModel) -> None:
    reports = [
        instance("A", 64, 63, batch=1, context=1000, waiting=[4] * 6),
        instance("B", 16, 2, batch=1, context=30),  # the least used, but 12 blocks to lend (2 kept as headroom)
        instance("C", 64, 16, batch=4, context=240),
    ]
    plan = plan_lending(reports, [request("a-long", "A", 63, 1000)], gpu_like, THRESHOLDS)
    # B's 11 blocks admit three (1 + 11 = 12); C's 12 the other three.
    assert plan.moves == (MoveOrder("a-long", "A", "B", 11), MoveOrder("a-long", "A", "C", 12))


def test_a_creditor_lends_no_block_its_own_queue_needs(gpu_like: AttentionTimeModel) -> None:
    reports = [
        instance("A", 64, 63, batch=1, context=1000, waiting=[4] * 6),
        instance("B", 64, 24, batch=3, context=180, waiting=[20]),  # 40 free, 20 of them for its waiting request
        instance("C", 64, 30, batch=4, context=240),
    ]
    plan = plan_lending(reports, [request("a-long", "A", 63, 1000)], gpu_like, THRESHOLDS)
    assert plan.moves == (MoveOrder("a-long", "A", "B", 19), MoveOrder("a-long", "A", "C", 4))


def test_the_plan_follows_the_fitted_model(gpu_like: AttentionTimeModel, attention_bound: AttentionTimeModel) -> None:
    # A long request alone on A, one 40-block request waiting; B busy with 16 short requests and memory to spare.
    reports = [
        instance("A", 256, 255, batch=1, context=4000, waiting=[40]),
        instance("B", 256, 100, batch=16, context=3200, max_batch=32),
    ]
    requests = [request("a-long", "A", 250, 4000)]
    # Where a step's fixed cost dominates, a second request on A nearly doubles its throughput for little on B.
    assert plan_lending(reports, requests, gpu_like, THRESHOLDS).moves == (MoveOrder("a-long", "A", "B", 39),)
    # Where attention dominates, 640 more tokens of it slow B's 16 requests more than A gains by its second.
    assert plan_lending(reports, requests, attention_bound, THRESHOLDS).moves == ()


def test_without_waiting_requests_only_attention_would_move_and_nothing_does(gpu_like: AttentionTimeModel) -> None:
    reports = [instance("A", 64, 63, batch=1, context=1000), instance("B", 64, 12, batch=3, context=180)]
    plan = plan_lending(reports, [request("a-long", "A", 63, 1000)], gpu_like, THRESHOLDS)
    assert plan.moves == () and plan.throughput_after == plan.throughput_before


@pytest.mark.parametrize(
    ("thresholds", "why"),
    [
        (LendingThresholds(debtor_max_batch=0), "A's batch of 1 is above the debtor threshold"),
        (LendingThresholds(creditor_max_usage=0.1), "B uses 19% of its blocks, above the creditor threshold"),
        (LendingThresholds(creditor_headroom=0.99), "B keeps all its blocks"),
        (LendingThresholds(min_gain=2.0), "no move triples the pair's throughput"),
    ],
)
def test_thresholds_keep_instances_out_of_the_plan(
    gpu_like: AttentionTimeModel, thresholds: LendingThresholds, why: str
) -> None:
    reports = [instance("A", 64, 63, batch=1, context=1000, waiting=[4] * 6), instance("B", 64, 12, 3, 180)]
    assert plan_lending(reports, [request("a-long", "A", 63, 1000)], gpu_like, thresholds).moves == (), why


def test_the_debtor_with_the_smallest_batch_goes_first(gpu_like: AttentionTimeModel) -> None:
    # Two debtors alike but for their batch, and one creditor with room for only one of them.
    reports = [
        instance("A", 64, 63, batch=2, context=1000, waiting=[8] * 2),
        instance("B", 64, 63, batch=1, context=1000, waiting=[8] * 2),
        instance("C", 64, 38, batch=8, context=400),  # 26 free, 6 kept: 20 to lend
    ]
    requests = [request("a-long", "A", 60, 960), request("b-long", "B", 60, 960)]
    plan = plan_lending(reports, requests, gpu_like, THRESHOLDS)
    # 1 free + 15 admits both of B's; the 5 left would admit none of A's.
    assert plan.moves == (MoveOrder("b-long", "B", "C", 15),)


def test_the_longest_request_moves_all_but_its_last_block(gpu_like: AttentionTimeModel) -> None:
    reports = [
        instance("A", 64, 63, batch=2, context=1000, waiting=[58]),
        instance("B", 256, 12, batch=3, context=180),
    ]
    requests = [request("short", "A", 5, 80), request("long", "A", 58, 920)]
    # 1 free + 57 admits the waiting request; the short request's 4 movable blocks would not.
    assert plan_lending(reports, requests, gpu_like, THRESHOLDS).moves == (MoveOrder("long", "A", "B", 57),)
    reports[0] = instance("A", 64, 63, batch=2, context=1000, waiting=[59])  # one more than can move
    assert plan_lending(reports, requests, gpu_like, THRESHOLDS).moves == ()


def test_an_instance_that_lends_does_not_borrow_in_the_same_plan(gpu_like: AttentionTimeModel) -> None:
    reports = [
        instance("A", 64, 63, batch=1, context=1000, waiting=[4] * 6),
        # The least used, and its waiting request (40 blocks) does not fit in its 34 free blocks either way.
        instance("B", 64, 30, batch=2, context=480, waiting=[40]),
        instance("C", 128, 64, batch=10, context=1000),
    ]
    requests = [request("a-long", "A", 63, 1000), request("b1", "B", 30, 480)]
    # Alone with C, B borrows the 6 blocks that admit its waiting request.
    assert plan_lending(reports[1:], requests, gpu_like, THRESHOLDS).moves == (MoveOrder("b1", "B", "C", 6),)
    # Once it has lent A 23 blocks, it would have to borrow 29 to admit it: blocks going round, so it does not.
    assert plan_lending(reports, requests, gpu_like, THRESHOLDS).moves == (MoveOrder("a-long", "A", "B", 23),)


def test_a_request_counts_on_its_pool_and_what_each_other_instance_lends_before_it_stops_being_a_creditor() -> None:
    assert request_pools(1, LendingThresholds()) == 1.0
    assert request_pools(3, LendingThresholds(creditor_max_usage=0.6, creditor_headroom=0.1)) == pytest.approx(2.2)
    # A creditor never lends its headroom, whatever its usage threshold.
    assert request_pools(2, LendingThresholds(creditor_max_usage=0.95, creditor_headroom=0.1)) == pytest.approx(1.9)

    # The server admits one pool unless asked for more (--lending-request-pools), and never more than that.
    assert served_request_pools(ClusterConfig(instances=3, kv_lending="on")) == 1.0
    assert served_request_pools(ClusterConfig(instances=3, lending_request_pools=2.0)) == 2.0
    assert served_request_pools(ClusterConfig(instances=3, lending_request_pools=9.0)) == pytest.approx(2.2)
    with pytest.raises(ConfigError, match="--lending-request-pools: must be >= 1"):
        ClusterConfig(lending_request_pools=0.5)
