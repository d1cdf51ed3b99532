"""What DistAttention costs: decode steps of one long request with part of its KV on another engine, against the
same request with all of it local.

Two engines in two processes over a real shared-memory transport (``engine/lending.py``): the debtor (this
process) prefills a prompt, moves a share of its blocks to the creditor (a child process, which answers the move
protocol's control calls over a pipe and serves partials on its server thread), and decodes; every layer of every
decode step then sends its query rows to the creditor, computes its local partial meanwhile, waits for the
creditor's partial and merges. Reported per share of the context moved: decode step time (median), and per step
the DistAttention layer calls' time split into sending, local partial, exposed wait (after the local partial was
done) and merge, the round trip per layer and its bytes. The shares take turns, ``--repeats`` times. Usage::

    python scripts/distattn_overhead.py [--model smollm2-135m] [--context 2048] [--tokens 32]
        [--shares 0,0.5,0.9] [--repeats 3] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time

import torch

from boundless.cluster.rmanager import RManager, SendBlocks, TryMove
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.lending import LendingAgent
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import load_model
from boundless.transport.shm import ShmTransport


def _engine(loaded, context: int, tokens: int) -> EngineCore:
    blocks = 2 * ((context + tokens) // 16 + 8)
    config = EngineConfig(
        model=ModelConfig(max_model_len=context + tokens + 16),
        cache=CacheConfig(num_kv_blocks=blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=1024),
    )
    return EngineCore.from_model(loaded, config)


def _agent(loaded, net: ShmTransport, control, context: int, tokens: int) -> LendingAgent:
    core = _engine(loaded, context, tokens)
    rm = RManager(net.address, core.layout.num_blocks, 16, time.monotonic, reservation_timeout_s=60)
    return LendingAgent(core, rm, net, control, timeout_s=60)


def creditor_main(conn, model: str, shm_dir: str, context: int, tokens: int, threads: int) -> None:
    """The creditor process: its engine and agent; control calls come over ``conn``."""
    torch.set_num_threads(threads)
    net = ShmTransport(shm_dir, "creditor")
    agent = _agent(load_model(model), net, None, context, tokens)
    receives = {}
    conn.send(net.address)
    while True:
        op, *args = conn.recv()
        if op == "try":
            conn.send(agent.on_try_move(args[0]))
        elif op == "take":
            receive = agent.on_take_blocks(args[0], args[1])
            if receive is not None:
                receives[args[0].move_id] = receive
            conn.send(receive is not None)
        elif op == "confirm":
            conn.send(agent.on_confirm_blocks(args[0], receives.pop(args[0])))
        elif op == "release":
            agent.on_release(args[0])
            conn.send(None)
        elif op == "stats":
            server = agent.data.server.stats
            conn.send((server.round_trips, server.compute_s, agent.core.kv.pool.num_used))
        else:
            break
    agent.close()
    net.close()


class PipeControlPlane:
    """The move protocol's control calls to the creditor process, over a pipe (the cluster's are Ray calls)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def _call(self, *msg):
        self.conn.send(msg)
        return self.conn.recv()

    def try_move(self, creditor: str, action: TryMove) -> bool:
        return self._call("try", action)

    def take_blocks(self, creditor: str, action: SendBlocks, debtor: str):
        return action.move_id if self._call("take", action, debtor) else None

    def confirm_blocks(self, creditor: str, move_id: str, receive) -> bool:
        return self._call("confirm", move_id)

    def release(self, creditor: str, move_id: str) -> None:
        self._call("release", move_id)


def run_once(debtor: LendingAgent, creditor: str, rid: str, share: float, context: int, tokens: int) -> dict:
    prompt = [100 + (j * 37) % 40000 for j in range(context)]
    debtor.core.add_request(rid, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    while debtor.core.scheduler.requests[rid].num_computed_tokens < context:
        debtor.step()
    moved = int(share * (context // 16))
    bytes_before = debtor.stats.bytes_out
    if moved:
        assert debtor.move_kvcache(rid, moved, creditor)
    s, c = debtor.attention.stats, debtor.client.stats
    base = (s.layers, s.layer_s, s.send_s, s.local_s, s.exposed_s, s.merge_s)
    cbase = (c.round_trips, c.bytes_sent, c.bytes_received, c.round_trip_s)
    step_s = []
    while debtor.core.has_unfinished():
        start = time.perf_counter()
        debtor.step()
        step_s.append(time.perf_counter() - start)
    n = len(step_s)
    trips = c.round_trips - cbase[0]
    return {
        "share": share,
        "blocks_moved": moved,
        "bytes_moved": debtor.stats.bytes_out - bytes_before,
        "step_s": step_s,
        "dist_layers_per_step": (s.layers - base[0]) / n,
        "layer_call_s_per_step": (s.layer_s - base[1]) / n,
        "send_s_per_step": (s.send_s - base[2]) / n,
        "local_s_per_step": (s.local_s - base[3]) / n,
        "exposed_s_per_step": (s.exposed_s - base[4]) / n,
        "merge_s_per_step": (s.merge_s - base[5]) / n,
        "round_trip_s": (c.round_trip_s - cbase[3]) / trips if trips else 0.0,
        "bytes_per_round_trip": ((c.bytes_sent - cbase[1]) + (c.bytes_received - cbase[2])) / trips if trips else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--shares", default="0,0.5,0.9")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    shares = [float(x) for x in args.shares.split(",")]
    runs: dict[float, list[dict]] = {s: [] for s in shares}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=creditor_main, args=(child, args.model, shm_dir, args.context, args.tokens, args.threads)
        )
        proc.start()
        creditor = parent.recv()
        net = ShmTransport(shm_dir, "debtor")
        debtor = _agent(loaded, net, PipeControlPlane(parent), args.context, args.tokens)
        try:
            run_once(debtor, creditor, "warmup", shares[-1], args.context, 2)
            for r in range(args.repeats):
                for share in shares:
                    runs[share].append(run_once(debtor, creditor, f"r{r}-{share}", share, args.context, args.tokens))
            parent.send(("stats",))
            server = parent.recv()
        finally:
            parent.send(("stop",))
            proc.join(timeout=30)
            debtor.close()
            net.close()
    print(f"creditor: {server[0]} partial requests served, {server[1]:.2f} s computing; blocks still lent: {server[2]}")
    rows = []
    base_ms = None
    print(
        "| share of context remote | blocks moved | MB moved | decode step ms (median) | vs all local |"
        " DistAttention layer calls ms/step | of which send | local partial | exposed wait | merge |"
        " round trip us/layer | bytes/round trip |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for share in shares:
        rs = runs[share]
        step_ms = statistics.median(x for r in rs for x in r["step_s"]) * 1e3
        base_ms = base_ms or step_ms

        def med(key: str, rs=rs) -> float:
            return statistics.median(r[key] for r in rs)

        row = {
            "share": share,
            "blocks_moved": rs[0]["blocks_moved"],
            "mb_moved": rs[0]["bytes_moved"] / 2**20,
            "step_ms": step_ms,
            "vs_local": step_ms / base_ms,
            "layer_calls_ms": med("layer_call_s_per_step") * 1e3,
            "send_ms": med("send_s_per_step") * 1e3,
            "local_ms": med("local_s_per_step") * 1e3,
            "exposed_ms": med("exposed_s_per_step") * 1e3,
            "merge_ms": med("merge_s_per_step") * 1e3,
            "round_trip_us": med("round_trip_s") * 1e6,
            "bytes_per_trip": med("bytes_per_round_trip"),
        }
        rows.append(row)
        print(
            f"| {share:.0%} | {row['blocks_moved']} | {row['mb_moved']:.1f} | {row['step_ms']:.1f} |"
            f" {row['vs_local']:.2f}x | {row['layer_calls_ms']:.1f} | {row['send_ms']:.1f} | {row['local_ms']:.1f} |"
            f" {row['exposed_ms']:.1f} | {row['merge_ms']:.1f} | {row['round_trip_us']:.0f} |"
            f" {row['bytes_per_trip']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "runs": {str(k): v for k, v in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
