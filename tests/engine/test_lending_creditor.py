"""A creditor's own long request while it hosts a peer's blocks (``lending_creditor_workload.py``): under the rule in
force its request grows into the whole pool, runs into the hosted blocks and is evicted; with the agent counting them
(``count_hosted``) it stops short of them, keeps its KV and waits, and is never preempted. Outputs are the same."""

from __future__ import annotations

from pathlib import Path

from lending_creditor_workload import PARAMS, Scenario, run
from lending_helpers import BLOCK

# No host memory and no prefix cache: an eviction is a recompute, whose tokens the figures count.
SCENARIO = Scenario(host_tier=False, prefix_caching=False, creditor_headroom=0.55)
B_WORK = 12 * BLOCK + PARAMS.max_tokens - 1  # b's prompt and its outputs but the last (sampled, never computed)


def test_a_creditor_counting_what_it_hosts_keeps_its_own_request_rather_than_evicting_it(load, tmp_path: Path) -> None:
    loaded = load("tiny-llama")
    before = run(loaded, tmp_path / "before", count_hosted=False, scenario=SCENARIO)
    after = run(loaded, tmp_path / "after", count_hosted=True, scenario=SCENARIO)
    for f in (before, after):
        assert f.hosted_when_b_came > 0 and f.moves > 0  # b came to an instance hosting a's blocks
        assert f.holds == 0 and f.preemptions[0] == 0
    # Before: b ran into the hosted blocks, was dropped and computed again.
    assert before.b_preemptions > 0 and before.swapped_recomputed == (0, before.b_preemptions)
    assert before.computed[1] > B_WORK
    # Counting them: b waited with its KV, computed once, and finished no later.
    assert after.b_preemptions == 0 and after.preemptions == (0, 0)
    assert after.computed[1] == B_WORK
    assert after.steps["b"] <= before.steps["b"] and after.steps["a"] == before.steps["a"]
    assert after.tokens == before.tokens and len(after.tokens["b"]) == PARAMS.max_tokens
