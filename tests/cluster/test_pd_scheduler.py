"""DualPath's inter-engine scheduler (section 4.3.1): each rule on its own, then rounds that chain them."""

from __future__ import annotations

import pytest

from boundless.cli import build_parser
from boundless.cluster.pd_scheduler import (
    EngineLoad,
    PDSchedulerConfig,
    PendingRequest,
    choose_read_path,
    classify_prefill,
    high_token_threshold,
    pick_decode_engine,
    pick_decode_group,
    pick_prefill_engine,
    plan_prefetches,
    read_queue_tokens,
    read_tokens,
    schedule,
)
from boundless.config import ClusterConfig, ConfigError, SchedulerConfig, from_flags

CFG = PDSchedulerConfig(alpha=100, beta=1000)


def pe(eid: str, node: str, tok: int = 0, read_queue: int = 0, seq: int = 0) -> EngineLoad:
    return EngineLoad(eid, "prefill", node, "pg", seq=seq, tok=tok, read_queue=read_queue)


def de(eid: str, node: str, group: str = "dg", tok: int = 0, seq: int = 0, free: int | None = None) -> EngineLoad:
    return EngineLoad(eid, "decode", node, group, seq=seq, tok=tok, kv_free_tokens=free)


def req(rid: str, num_tokens: int = 100, stored: int = 0) -> PendingRequest:
    return PendingRequest(rid, num_tokens, stored)


# -- PE rules ------------------------------------------------------------------------------------


def test_prefill_classes_follow_tokens_then_read_queue_at_the_boundaries() -> None:
    assert classify_prefill(pe("a", "n", tok=1000), 0, CFG) == "ideal"  # tok == beta is not over
    assert classify_prefill(pe("a", "n", tok=1001), 0, CFG) == "overloaded"
    assert classify_prefill(pe("a", "n", tok=1001), 10_000, CFG) == "overloaded"  # tokens first
    assert classify_prefill(pe("a", "n"), 100, CFG) == "ideal"  # queue == alpha is short
    assert classify_prefill(pe("a", "n"), 101, CFG) == "storage_pressed"


def test_prefill_prefers_ideal_over_pressed_then_fewest_tokens_and_never_overloaded() -> None:
    pes = [pe("over", "n0", tok=5000), pe("pressed", "n1"), pe("ideal_big", "n2", tok=900), pe("ideal", "n3", tok=800)]
    queues = {"n0": 0, "n1": 500, "n2": 0, "n3": 0}
    # The pressed PE has no tokens at all, yet an ideal one wins: its storage NIC would otherwise idle.
    assert pick_prefill_engine(pes, queues, CFG).engine_id == "ideal"
    assert pick_prefill_engine(pes[:2], queues, CFG).engine_id == "pressed"
    assert pick_prefill_engine(pes[:1], queues, CFG) is None


def test_a_prefill_engine_without_room_for_the_prompt_is_skipped_and_none_left_stops_the_round() -> None:
    roomy, full = pe("roomy", "n0", tok=900), EngineLoad("full", "prefill", "n1", "pg", kv_free_tokens=50)
    queues = {"n0": 0, "n1": 0}
    # The full PE has the fewest tokens, but not the room for a 100-token prompt beside what it holds.
    assert pick_prefill_engine([full, roomy], queues, CFG, 100).engine_id == "roomy"
    assert pick_prefill_engine([full, roomy], queues, CFG, 50).engine_id == "full"
    loads = [EngineLoad("p", "prefill", "n0", "pg", kv_free_tokens=250), de("d", "n1")]
    result = schedule([req("a", 100), req("b", 100), req("c", 100), req("d", 10)], loads, CFG)
    # Two prompts fit in the PE's 250 tokens; the third waits for a handoff, and the fourth behind it (FIFO).
    assert [p.request_id for p in result.placements] == ["a", "b"]
    assert [r.request_id for r in result.waiting] == ["c", "d"]
    assert {e.engine_id: e.kv_free_tokens for e in result.loads}["p"] == 50


def test_a_request_waits_while_every_prefill_engine_is_overloaded_and_fifo_holds() -> None:
    loads = [pe("p", "n0", tok=2000), de("d", "n1")]
    result = schedule([req("big", 500), req("small", 1)], loads, CFG)
    assert result.placements == () and [r.request_id for r in result.waiting] == ["big", "small"]


def test_a_prefill_engine_under_beta_takes_one_request_longer_than_beta() -> None:
    result = schedule([req("huge", 50_000), req("next", 10)], [pe("p", "n0"), de("d", "n1")], CFG)
    assert [p.request_id for p in result.placements] == ["huge"]  # then p is overloaded: next waits
    assert [r.request_id for r in result.waiting] == ["next"]


def test_placements_are_accounted_so_a_burst_spreads_over_prefill_engines() -> None:
    loads = [pe("p0", "n0"), pe("p1", "n1"), de("d", "n2")]
    result = schedule([req(f"r{i}", 300) for i in range(4)], loads, CFG)
    assert [p.prefill_engine for p in result.placements] == ["p0", "p1", "p0", "p1"]
    after = {e.engine_id: e for e in result.loads}
    assert (after["p0"].seq, after["p0"].tok, after["d"].seq, after["d"].tok) == (2, 600, 4, 1200)


# -- DE rules ------------------------------------------------------------------------------------


def test_decode_group_with_fewest_tokens_among_those_with_room() -> None:
    des = [de("a1", "na", "A", tok=300), de("a2", "na", "A", tok=300), de("b1", "nb", "B", tok=500, free=50)]
    assert pick_decode_group(des, 10) == "B"  # 500 < 600 tokens
    assert pick_decode_group(des, 100) == "A"  # B has no DE with room for 100 tokens


def test_a_burst_is_drained_to_the_group_with_fewest_tokens_request_by_request() -> None:
    loads = [pe("p", "n0"), de("a", "na", "A", tok=0), de("b", "nb", "B", tok=150)]
    result = schedule([req(f"r{i}", 100) for i in range(4)], loads, PDSchedulerConfig(alpha=100, beta=10**6))
    # A (0) < B (150); then A has 100, still fewer; then 200 > 150: B; then A 200 < B 250.
    assert [p.decode_engine for p in result.placements] == ["a", "a", "b", "a"]


def test_within_a_group_the_fewest_requests_under_z_win_and_only_then_the_fewest_tokens() -> None:
    group = [de("many_small", "n", seq=5, tok=100), de("few_big", "n", seq=1, tok=800), de("mid", "n", seq=3, tok=200)]
    # Z = 1000: few_big reaches exactly Z (800 + 200), which is still under it, and wins on requests.
    assert pick_decode_engine(group, 200, z=1000).engine_id == "few_big"
    # Z = 500: few_big would pass Z; of the two under it, mid has fewer requests.
    assert pick_decode_engine(group, 200, z=500).engine_id == "mid"
    # Z = 150: every DE would pass it: the fewest tokens, to keep away from its memory running out.
    assert pick_decode_engine(group, 200, z=150).engine_id == "many_small"


def test_a_decode_engine_without_kv_room_is_skipped_and_none_left_stops_the_round() -> None:
    group = [de("full", "n", seq=0, tok=0, free=50), de("roomy", "n", seq=9, tok=900, free=5000)]
    assert pick_decode_engine(group, 100, z=10**6).engine_id == "roomy"
    loads = [pe("p", "n0"), de("d", "n1", free=250)]
    result = schedule([req("a", 100), req("b", 100), req("c", 100), req("d", 10)], loads, CFG)
    # Two fit in 250 tokens; the third finds no room, and the fourth waits behind it (FIFO).
    assert [p.request_id for p in result.placements] == ["a", "b"]
    assert [r.request_id for r in result.waiting] == ["c", "d"]
    assert {e.engine_id: e.kv_free_tokens for e in result.loads}["d"] == 50


def test_z_is_the_groups_tokens_per_engine_after_the_requests_that_fit() -> None:
    group = [de("a", "n", tok=100, free=300), de("b", "n", tok=300, free=100)]
    assert high_token_threshold(group, [200, 100]) == (400 + 300) / 2
    assert high_token_threshold(group, [200, 300, 100]) == (400 + 200) / 2  # 300 no longer fits; FIFO stops
    assert high_token_threshold([de("u", "n", tok=10)], [5, 5]) == 20  # unlimited memory: all of them


def test_a_fixed_z_replaces_the_derived_one() -> None:
    loads = [pe("p", "n0"), de("busy", "n1", seq=4, tok=100), de("idle", "n1", seq=0, tok=400)]
    derived = schedule([req("r", 100)], loads, CFG)  # Z = (500 + 100) / 2 = 300: idle would pass it
    fixed = schedule([req("r", 100)], loads, PDSchedulerConfig(alpha=100, beta=1000, z=10_000))
    assert derived.placements[0].decode_engine == "busy"
    assert fixed.placements[0].decode_engine == "idle"  # under Z both: the fewest requests


# -- read paths ----------------------------------------------------------------------------------


def test_read_path_per_mode() -> None:
    stored = req("r", 1000, stored=900)
    assert choose_read_path("dualpath", stored, pe_queue=500, de_queue=100, same_node=False) == "de"
    assert choose_read_path("dualpath", stored, pe_queue=100, de_queue=500, same_node=False) == "pe"
    assert choose_read_path("dualpath", stored, pe_queue=300, de_queue=300, same_node=False) == "de"  # tie: the DE
    assert choose_read_path("dualpath", stored, pe_queue=500, de_queue=0, same_node=True) == "pe"  # one NIC either way
    assert choose_read_path("basic", stored, pe_queue=500, de_queue=0, same_node=False) == "pe"
    assert choose_read_path("oracle", stored, pe_queue=0, de_queue=0, same_node=False) == "none"
    assert choose_read_path("dualpath", req("cold", 1000), pe_queue=500, de_queue=0, same_node=False) == "none"


def test_each_path_reads_what_its_engines_lack() -> None:
    # The PE served the program's last prompt (416 tokens of the 480 stored), the DE decoded it (all 480).
    turn = PendingRequest("next", 500, 480, in_memory={"p": 416, "d": 480})
    assert read_tokens(turn, "pe", "p", "d") == 64  # the blocks the DE wrote after the PE's prompt
    assert read_tokens(turn, "de", "p", "d") == 0  # the DE pushes them from its memory
    assert read_tokens(turn, "pe", "p2", "d2") == 480 and read_tokens(turn, "de", "p2", "d2") == 480  # other engines
    assert read_tokens(turn, "de", "p", "d2") == 64  # a DE that holds nothing reads only what the PE lacks
    assert read_tokens(turn, "none", "p", "d") == 0


def test_the_path_balances_the_bytes_each_link_will_carry_not_the_queues_lengths() -> None:
    # The DE holds this turn's context: DE-read adds nothing to its link, PE-read would read it all on the PE's,
    # so the DE's longer queue still finishes first (the old rule, shorter queue, read it on the PE).
    held = PendingRequest("held", 500, 480, in_memory={"d": 480})
    assert choose_read_path("dualpath", held, pe_queue=0, de_queue=200, same_node=False, pe_id="p", de_id="d") == "de"
    # Queue plus read: 100 + 64 on the PE against 170 + 0 on the DE; at 164 a tie, which goes to the DE.
    turn = PendingRequest("next", 500, 480, in_memory={"p": 416, "d": 480})
    assert choose_read_path("dualpath", turn, pe_queue=100, de_queue=170, same_node=False, pe_id="p", de_id="d") == "pe"
    assert choose_read_path("dualpath", turn, pe_queue=100, de_queue=164, same_node=False, pe_id="p", de_id="d") == "de"
    # The PE holds all of it: nothing to read on either path, so no push either.
    whole = PendingRequest("whole", 500, 480, in_memory={"p": 480})
    assert choose_read_path("dualpath", whole, pe_queue=500, de_queue=0, same_node=False, pe_id="p", de_id="d") == "pe"


def test_a_round_queues_the_reads_its_paths_will_carry() -> None:
    # A next turn (its context on both engines) then a whole first context, both links idle. The old rule read the
    # turn on the PE (a tie) and counted its 480 stored tokens there, which sent the first context to the DE; both
    # links looked equally loaded, while the PE's would carry 64 tokens and the DE's 480. Now the turn reads nothing
    # on the DE, and the first context's tie goes to the DE as well: the queues say what each link will carry.
    loads = [pe("p", "np"), de("d", "nd")]
    queue = [PendingRequest("next", 500, 480, in_memory={"p": 416, "d": 480}), req("first", 500, 480)]
    result = schedule(queue, loads, PDSchedulerConfig(alpha=10**6, beta=10**6))
    assert [(p.read_path, p.read_tokens) for p in result.placements] == [("de", 0), ("de", 480)]
    assert dict(result.read_queues) == {"np": 0, "nd": 480}


def test_dualpath_spreads_reads_over_both_nodes_where_basic_piles_them_on_the_prefill_node() -> None:
    loads = [pe("p", "np"), de("d", "nd")]
    queue = [req(f"r{i}", 1000, stored=900) for i in range(4)]
    loose = PDSchedulerConfig(alpha=10**6, beta=10**6)
    dual = schedule(queue, loads, loose)
    assert [p.read_path for p in dual.placements] == ["de", "pe", "de", "pe"]
    assert dict(dual.read_queues) == {"np": 1800, "nd": 1800}
    basic = schedule(queue, loads, PDSchedulerConfig(alpha=10**6, beta=10**6, kv_path="basic"))
    assert dict(basic.read_queues) == {"np": 3600, "nd": 0}
    oracle = schedule(queue, loads, PDSchedulerConfig(alpha=10**6, beta=10**6, kv_path="oracle"))
    assert dict(oracle.read_queues) == {"np": 0, "nd": 0} and {p.read_tokens for p in oracle.placements} == {0}
    assert {e.engine_id: e.read_queue for e in dual.loads} == {"p": 1800, "d": 1800}


def test_reads_landing_on_a_prefill_node_make_it_storage_pressed_for_the_next_request() -> None:
    loads = [pe("p0", "n0"), pe("p1", "n1", tok=500), de("d", "n0")]  # d shares p0's node: one NIC
    result = schedule([req("a", 200, stored=150), req("b", 200, stored=150)], loads, CFG)
    # a goes to p0 (ideal, fewest tokens) and reads 150 > alpha on n0: p0 is now storage-pressed,
    # so b goes to p1 (ideal) although p1 has more tokens.
    assert [p.prefill_engine for p in result.placements] == ["p0", "p1"]


def test_engines_of_a_node_share_its_longest_reported_queue() -> None:
    loads = [pe("p0", "n0", read_queue=0), pe("p1", "n0", read_queue=500), pe("p2", "n1", tok=900), de("d", "n2")]
    result = schedule([req("r", 10)], loads, CFG)
    assert result.placements[0].prefill_engine == "p2"  # n0's queue is 500 for both of its PEs


# -- config --------------------------------------------------------------------------------------


# -- reads ahead for waiting requests ---------------------------------------------------------------


def test_waiting_requests_are_read_ahead_in_fifo_order_on_the_shorter_queue_within_each_engines_room() -> None:
    loads = [pe("p", "n0", read_queue=50), de("d", "n1", free=0)]  # the DE has no KV room: everyone waits
    queue = [req("a", 100, 80), req("b", 100, 0), req("c", 100, 80), req("d", 100, 80), req("e", 100, 10)]
    queue += [req("f", 100, 80), req("g", 100, 5)]
    planned, queues = plan_prefetches(queue, loads, {"p": 200, "d": 100}, CFG)
    # a reads on the DE's node (queue 0 < 50), c on the PE's (50 < 80); d's shorter queue is the DE's, whose room
    # (20 left) is too small: the PE's takes it. b has nothing stored. f fits nowhere: the round ends there, and g,
    # behind it, waits for the room to go to f first.
    assert [(r.request_id, r.engine_id, r.read_path, r.read_tokens) for r in planned] == [
        ("a", "d", "de", 80),
        ("c", "p", "pe", 80),
        ("d", "p", "pe", 80),
        ("e", "d", "de", 10),
    ]
    assert queues == {"n0": 210, "n1": 90}  # each read joined its node's queue before the next was decided
    # Under basic only the PE reads ahead; under oracle nothing is read.
    basic = PDSchedulerConfig(alpha=100, beta=1000, kv_path="basic")
    planned, _ = plan_prefetches(queue, loads, {"p": 100, "d": 1000}, basic)
    assert [(r.request_id, r.engine_id) for r in planned] == [("a", "p")]
    oracle = PDSchedulerConfig(alpha=100, beta=1000, kv_path="oracle")
    assert plan_prefetches(queue, loads, {"p": 1000, "d": 1000}, oracle)[0] == ()


def test_a_request_read_ahead_is_placed_where_its_blocks_are_and_reads_nothing_more() -> None:
    loads = [pe("p0", "n0"), pe("p1", "n1", tok=10), de("d", "n2", free=1000)]
    queues_say_de = [pe("p0", "n0", read_queue=500), pe("p1", "n1", tok=10, read_queue=500), de("d", "n2", free=1000)]
    # Read ahead on p1 (not the PE the rules pick, and the DE's queue is the shorter): placed on p1, PE-read.
    ahead = PendingRequest("a", 100, 80, prefetched_on="p1")
    (placed,) = schedule([ahead], queues_say_de, CFG).placements
    assert (placed.prefill_engine, placed.read_path, placed.read_tokens) == ("p1", "pe", 0)
    # Read ahead on the DE: DE-read, whatever the queues say.
    (placed,) = schedule([PendingRequest("b", 100, 80, prefetched_on="d")], loads, CFG).placements
    assert (placed.decode_engine, placed.read_path, placed.read_tokens) == ("d", "de", 0)
    # Read ahead on a PE that is overloaded now: the rules' PE, and the rules' path (its blocks there are cache; the
    # queues tie, so the DE reads).
    over = [pe("p0", "n0"), pe("p1", "n1", tok=5000), de("d", "n2", free=1000)]
    (placed,) = schedule([ahead], over, CFG).placements
    assert (placed.prefill_engine, placed.read_path, placed.read_tokens) == ("p0", "de", 80)


def test_thresholds_default_to_multiples_of_the_step_budget_and_flags_override_them() -> None:
    cfg = PDSchedulerConfig.from_configs(ClusterConfig(), SchedulerConfig(max_num_batched_tokens=512))
    assert (cfg.alpha, cfg.beta, cfg.z, cfg.kv_path) == (512, 4096, None, "dualpath")
    args = build_parser().parse_args(
        ["serve", "--pd-alpha", "7", "--pd-beta", "9", "--pd-z", "11", "--kv-path", "basic", "--storage-gbps", "2.5"]
    )
    cluster = from_flags(ClusterConfig, args)
    cfg = PDSchedulerConfig.from_configs(cluster, SchedulerConfig())
    assert (cfg.alpha, cfg.beta, cfg.z, cfg.kv_path, cluster.storage_gbps) == (7, 9, 11, "basic", 2.5)


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("kv_path", "both", "--kv-path"), ("pd_beta", -1, "--pd-beta"), ("net_gbps", 0.0, "--net-gbps")],
)
def test_bad_values_fail_at_start_up_naming_the_flag(field: str, value: object, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ClusterConfig(**{field: value})


def test_read_queue_in_tokens_rounds_up() -> None:
    assert read_queue_tokens(0, 64) == 0 and read_queue_tokens(1, 64) == 1 and read_queue_tokens(128, 64) == 2
