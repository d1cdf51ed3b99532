"""A creditor that gets a long request of its own while it hosts a peer's blocks (KV lending), on two real engines
over shared memory with the gManager beside them, as the router holds it (``test_lending_hold.py``'s harness).

Instance 0 runs ``a``, longer than its pool: granted, it fills its pool and the gManager lends part of it to instance
1. Once instance 1 hosts those blocks, ``b`` arrives there: it fits instance 1's pool, but not the pool less what it
hosts. The figures: preemptions (swapped out or dropped to recompute) on each instance and of ``b``, the steps each
request took, the tokens each instance computed, the moves and holds, and the wall time; under the rule in force (the
creditor's requests may fill its whole pool, ``count_hosted=False``) and with the agent counting the hosted blocks
(``LendingAgent(count_hosted=True)``). ``docs/lending.md``, "A creditor's own requests", has the figures.

    .venv/bin/python tests/engine/lending_creditor_workload.py          # every scenario, both rules, twice
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from lending_helpers import BLOCK, CHUNK, Recorded

from boundless.cluster.gmanager import GManager
from boundless.cluster.lending_cluster import ClusterLending, OrderHold
from boundless.cluster.lending_plan import LendingThresholds
from boundless.cluster.rmanager import RManager
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import AttentionTimeModel
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.lending import LendingAgent, LocalControlPlane
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel
from boundless.transport.shm import ShmTransport

POOL = 16  # blocks of 16 tokens: 256 tokens an instance
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
A_PROMPT = [(13 * j) % 300 + 3 for j in range(20 * BLOCK)]  # 21 blocks at its peak: over its pool, granted
# The planner's cost model, fixed (a step's fixed cost dominates, as on a GPU): fitted from this machine's wall times
# the plans, and so the figures, changed from run to run.
GPU_LIKE = AttentionTimeModel(base_s=0.03, per_seq_s=0.0003, per_token_s=0.0002, per_pair_s=1e-6)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """``b`` of ``b_blocks`` prompt blocks (and 12 tokens out) on the creditor, ``shorts`` short requests beside it
    (3 blocks each, arriving with it), prefix caching on or off, and the planner's creditor thresholds."""

    b_blocks: int = 12
    shorts: int = 0
    prefix_caching: bool = True
    host_tier: bool = True  # host memory for KV (the default 1 GiB): a preemption swaps out; without, recomputes
    creditor_max_usage: float = 0.6
    creditor_headroom: float = 0.1

    def prompts(self) -> dict[str, list[int]]:
        out = {"b": [(17 * j) % 300 + 5 for j in range(self.b_blocks * BLOCK)]}
        for i in range(self.shorts):
            out[f"s{i}"] = [(19 * j + i) % 300 + 7 for j in range(3 * BLOCK)]
        return out


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Figures:
    count_hosted: bool
    hosted_when_b_came: int  # blocks instance 1 held for instance 0 as b arrived
    preemptions: tuple[int, int]  # on instance 0, on instance 1
    swapped_recomputed: tuple[int, int]  # instance 1's preemptions: swapped out to host memory, dropped to recompute
    b_preemptions: int
    steps: dict[str, int]  # cluster steps from its arrival to its last token, each request
    computed: tuple[int, int]  # tokens each instance's steps computed (recomputations included)
    moves: int
    holds: int
    wall_s: float
    tokens: dict[str, list[int]]


def _engine(loaded: LoadedModel, prefix_caching: bool, host_tier: bool) -> EngineCore:
    """An engine of ``POOL`` blocks that admits two pools' worth a request (as lending's ``--lending-request-pools``
    does)."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=POOL * BLOCK, attention_backend="torch"),
        cache=CacheConfig(
            num_kv_blocks=POOL, enable_prefix_caching=prefix_caching, kv_host_gb=None if host_tier else 0.0
        ),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=CHUNK),
    )
    layout = dataclasses.replace(size_engine(config, loaded.arch, loaded.dtype), max_model_len=2 * POOL * BLOCK)
    return EngineCore(
        config,
        layout,
        ModelIdentity.of(loaded, layout),
        loaded.tokenizer,
        build_model_executor(loaded, config, layout),
    )


def _count_computed(core: EngineCore, counts: list[int], i: int) -> None:
    runner = core.executor.runner
    forward = runner.forward

    def counting(sched, on_layer=None, before_layer=None, follows=None):
        counts[i] += sum(len(c.token_ids) for c in sched.chunks)
        return forward(sched, on_layer, before_layer, follows)

    runner.forward = counting


def run(
    loaded: LoadedModel, shm_dir: Path, count_hosted: bool, scenario: Scenario = Scenario(), max_steps: int = 400
) -> Figures:
    """The workload on two engines of ``POOL`` blocks; raises if it does not finish in ``max_steps``."""
    clock = Clock()
    control = LocalControlPlane()
    nets = [ShmTransport(shm_dir, f"i{i}", timeout_s=10) for i in range(2)]
    agents = []
    computed = [0, 0]
    for i, net in enumerate(nets):
        core = _engine(loaded, scenario.prefix_caching, scenario.host_tier)
        _count_computed(core, computed, i)
        rm = RManager(net.address, core.layout.num_blocks, BLOCK, clock, reservation_timeout_s=30)
        agents.append(control.add(LendingAgent(core, rm, net, control, timeout_s=10, count_hosted=count_hosted)))
    try:
        figures = _drive(agents, clock, count_hosted, scenario, max_steps)
        figures.computed = (computed[0], computed[1])
        return figures
    finally:
        for agent in agents:
            agent.close()
        for net in nets:
            net.close()


def _drive(agents: list[LendingAgent], clock: Clock, count_hosted: bool, scenario: Scenario, max_steps: int) -> Figures:
    by_id = {str(i): agent for i, agent in enumerate(agents)}
    thresholds = LendingThresholds(
        creditor_max_usage=scenario.creditor_max_usage, creditor_headroom=scenario.creditor_headroom
    )
    gm = GManager(thresholds, interval_s=1.0, heartbeat_timeout_s=10.0, clock=clock)
    gm.model = lambda: GPU_LIKE  # type: ignore[method-assign]
    lending = ClusterLending(gm, {iid: agent.instance_id for iid, agent in by_id.items()})
    recs = [Recorded(), Recorded()]
    debtor, creditor = agents
    debtor.core.add_request("a", A_PROMPT, PARAMS)
    arrived: dict[str, int] = {"a": 0}
    done: dict[str, int] = {}
    hosted_at_b = -1
    holds = 0
    prompts = scenario.prompts()
    start = time.perf_counter()
    for n in range(max_steps):
        if "b" not in arrived and creditor.rm.lent_blocks > 0:
            hosted_at_b = creditor.rm.lent_blocks
            for rid, prompt in prompts.items():
                creditor.core.add_request(rid, prompt, PARAMS)
                arrived[rid] = n
            b = creditor.core.scheduler.requests["b"]  # (kept: its count outlives its end)
        if len(done) == 1 + len(prompts):
            break
        for agent, rec in zip(agents, recs, strict=True):
            for delta in agent.step():
                rec.add(delta)
                if delta.finished:
                    done[delta.request_id] = n + 1
        clock.now += 1.0
        for agent in agents:  # each instance's heartbeat, as InstanceLending.heartbeat makes it
            agent.observe()
            agent.apply(agent.rm.expire())
            lending.on_heartbeat(agent.heartbeat())
        for order in lending.orders():
            holds += isinstance(order, OrderHold)
            by_id[order.instance_id].carry_out(order)
    else:
        raise RuntimeError(f"not done in {max_steps} steps: {done}")
    wall = time.perf_counter() - start
    return Figures(
        count_hosted=count_hosted,
        hosted_when_b_came=hosted_at_b,
        preemptions=(debtor.core.scheduler.stats.num_preemptions, creditor.core.scheduler.stats.num_preemptions),
        swapped_recomputed=(
            creditor.core.scheduler.stats.num_swapped_out,
            creditor.core.scheduler.stats.num_recomputed,
        ),
        b_preemptions=b.num_preemptions,
        steps={rid: done[rid] - arrived[rid] for rid in done},
        computed=(0, 0),
        moves=sum(agent.stats.moves_out for agent in agents),
        holds=holds,
        wall_s=wall,
        tokens={rid: toks for rec in recs for rid, toks in rec.tokens.items()},
    )


SCENARIOS = {
    "b 12 blocks, prefix cache": Scenario(),
    "b 12 blocks, no prefix cache": Scenario(prefix_caching=False),
    "b 12 blocks + 2 shorts, no prefix cache": Scenario(shorts=2, prefix_caching=False),
    "creditor lends 7 blocks, b 12": Scenario(creditor_headroom=0.55),
    "creditor lends 7 blocks, b 12, no host tier": Scenario(host_tier=False, creditor_headroom=0.55),
    "creditor lends 7 blocks, b 12, no host tier, no prefix cache": Scenario(
        host_tier=False, prefix_caching=False, creditor_headroom=0.55
    ),
    "creditor lends 7 blocks, b 12 + 2 shorts, no host tier": Scenario(
        shorts=2, host_tier=False, creditor_headroom=0.55
    ),
}


def main() -> None:
    import importlib.util
    import tempfile

    from boundless.model.loader import load_model
    from boundless.model.random_model import write_random_model

    spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).parents[1] / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)  # (the tiny models' specs, and the test suite's thread count)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_random_model(root / "tiny-llama", conftest.TINY_SPECS["tiny-llama"])
        loaded = load_model(str(model), device="cpu")
        head = (
            "rule          hosted  preempt(i0,i1)  i1 swap,recomp  b preempt  steps a  steps b  steps shorts  "
            "computed(i0,i1)  moves"
        )
        for name, scenario in SCENARIOS.items():
            print(f"\n{name}\n{head}  holds  wall s")
            for rep in range(2):
                for count_hosted in (False, True):
                    f = run(loaded, root / f"shm-{len(name)}-{rep}-{count_hosted}", count_hosted, scenario)
                    shorts = sorted(v for k, v in f.steps.items() if k.startswith("s"))
                    print(
                        f"{'count hosted' if count_hosted else 'whole pool':13} {f.hosted_when_b_came:6} "
                        f"{f.preemptions!s:>15} {f.swapped_recomputed!s:>15} {f.b_preemptions:10} "
                        f"{f.steps['a']:8} {f.steps['b']:8} "
                        f"{shorts!s:>13} {f.computed!s:>16} {f.moves:6} {f.holds:6} {f.wall_s:7.2f}"
                    )


if __name__ == "__main__":
    main()
