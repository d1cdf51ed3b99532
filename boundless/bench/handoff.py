"""``boundless bench handoff``: how much of a prefill engine's KV handoff the layerwise stream hides behind
its forward pass.

A prefill engine (PE) and a decode engine (DE) in this process, over shared memory, the PE's sends through
an emulated network link at ``--net-gbps`` (``cluster/links.py``). For each prompt length, requests are
prefilled on the PE and handed to the DE (``engine/handoff.py``) in two modes, on the same engines:

- ``layerwise``: layer ``i`` of the blocks goes out as soon as the forward pass has stored it;
- ``after``: every layer goes out once the forward pass is over (the baseline).

Per run: ``prefill_s``, the PE's step from the request's arrival to its first token; ``stream_s``, the
stream from its first message to its last; ``exposed_s``, the part of the stream after the forward pass
ended (what the overlap did not hide); and ``ready_s`` = ``prefill_s`` + ``exposed_s``, when the DE holds
every block and could decode. Medians over ``--repeats`` (each with a fresh prompt, so nothing is cached).

``--receive`` measures the other side, a request whose stored context is loaded (``kv/layer_gate.py``): one
engine over a disk store behind an emulated storage link at ``--storage-gbps``; each prompt is a fresh context
of ``--prompt-tokens`` (written to the store by a first run, then dropped from memory) and ``--append-tokens``
of new input; its time to first token with the load taken ``whole`` before the prefill, or ``layerwise``
(the prefill runs while the load crosses the link, each layer waiting for its own KV), on the same engine.

``--receive --push`` measures DE-read: a DE loads the context behind its storage link and pushes it to a PE over
``--net-gbps``, in three modes on the same engines: ``whole`` (the push starts once the load has landed),
``layerwise`` (each layer goes out as it crosses the DE's storage link; the PE still waits for the whole push),
and ``layerwise+pe`` (``--layerwise-load on``: the push's count comes first, and the PE runs the prefill as the
push's layers land, each layer of its forward pass waiting for that layer).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from boundless.bench.report import output_path, print_table, write_json
from boundless.cluster.links import Link, ThrottledLink, gbps_to_bytes_per_s
from boundless.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    comma_numbers,
    positive_float,
    positive_int,
)
from boundless.engine.core import EngineCore
from boundless.engine.executor import ModelExecutor
from boundless.engine.handoff import HandoffPlan, IntakePlan
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.tensors import PagedKVCache
from boundless.model.loader import LoadedModel, load_model
from boundless.transport.shm import ShmTransport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", default="512,2048", help="prompt lengths, comma-separated")
    parser.add_argument("--net-gbps", type=positive_float, default=1.0, help="the PE's emulated network link")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument(
        "--receive", action="store_true", help="the receive side: a stored context loaded whole, or layer by layer"
    )
    parser.add_argument("--storage-gbps", type=positive_float, default=2.0, help="--receive: the engine's storage link")
    parser.add_argument(
        "--append-tokens", type=positive_int, default=256, help="--receive: new input after the context"
    )
    parser.add_argument(
        "--push",
        action="store_true",
        help="--receive on the DE-read path: a decode engine loads the context and pushes it to a prefill engine "
        "over --net-gbps, whole once loaded, layer by layer as it loads, or layer by layer with the prefill engine "
        "prefilling as the layers land (layerwise+pe)",
    )
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")


def _config(loaded: LoadedModel, max_tokens: int) -> EngineConfig:
    blocks = max_tokens // 16 + 8
    return EngineConfig(
        model=ModelConfig(model=loaded.name, max_model_len=min(blocks * 16, loaded.arch.context_length)),
        cache=CacheConfig(num_kv_blocks=blocks, kv_host_gb=blocks * 1.0e-3, enable_prefix_caching=True),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=max(2048, max_tokens)),
    )


def _one(pe: EngineCore, de: EngineCore, pe_net: ShmTransport, de_net: ShmTransport, rid: str, prompt: list[int]):
    """One handoff: (prefill_s, stream_s, exposed_s)."""
    before = pe.stats().remote_io
    assert before is not None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    start = time.perf_counter()
    answer = de.prepare_intake(rid, prompt, params, IntakePlan(pe_net.address, recv_tag=hash(rid) & 0xFFFFFF))
    plan = HandoffPlan(de_net.address, hash(rid) & 0xFFFFFF, answer.send_from_block)
    pe.add_request(rid, prompt, params, handoff=plan)
    while pe.has_unfinished():
        pe.step()
    prefill_s = time.perf_counter() - start
    while pe.kv.num_remote_in_flight or de.kv.is_receiving(rid):
        pe.step()
        de.step()
    de.abort(rid)
    after = pe.stats().remote_io
    assert after is not None and after.send_failures == before.send_failures, "the stream failed"
    return (
        prefill_s,
        after.layerwise_stream_s - before.layerwise_stream_s,
        (after.layerwise_exposed_s - before.layerwise_exposed_s),
    )


def measure(loaded: LoadedModel, lengths: list[int], net_gbps: float, repeats: int) -> list[dict[str, Any]]:
    rows = []
    config = _config(loaded, max(lengths))
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.arch.vocab_size
    with tempfile.TemporaryDirectory(prefix="boundless-handoff-", dir="/dev/shm") as directory:
        for mode in ("layerwise", "after"):
            pe_net = ShmTransport(directory, f"pe-{mode}")
            de_net = ShmTransport(directory, f"de-{mode}")
            pe, de = EngineCore.from_model(loaded, config), EngineCore.from_model(loaded, config)
            link = ThrottledLink(Link("net", gbps_to_bytes_per_s(net_gbps)), time.monotonic, time.sleep)
            pe.connect(pe_net, throttle=link.transfer, layerwise=mode == "layerwise")
            de.connect(de_net)
            _one(pe, de, pe_net, de_net, f"warm-{mode}", torch.randint(3, vocab, (64,)).tolist())
            for length in lengths:
                runs = []
                for r in range(repeats):
                    prompt = torch.randint(3, vocab, (length,), generator=generator).tolist()
                    runs.append(_one(pe, de, pe_net, de_net, f"{mode}-{length}-{r}", prompt))
                prefill, stream, exposed = (statistics.median(x) for x in zip(*runs, strict=True))
                kv_mb = (length // 16) * pe.layout.bytes_per_block / 1e6
                rows.append(
                    {"mode": mode, "prompt_tokens": length, "kv_mb": round(kv_mb, 1), "prefill_s": prefill,
                     "stream_s": stream, "exposed_s": exposed, "ready_s": prefill + exposed,
                     "hidden": max(0.0, 1 - exposed / stream) if stream else 0.0}
                )  # fmt: skip
            pe_net.close()
            de_net.close()
    return rows


def _receive_config(loaded: LoadedModel, store: str, max_tokens: int) -> EngineConfig:
    blocks = max_tokens // 16 + 8
    arch = loaded.arch
    per_block = PagedKVCache.bytes_per_block(arch.num_layers, arch.num_kv_heads, arch.head_dim, 16, loaded.dtype)
    return EngineConfig(
        model=ModelConfig(model=loaded.name, max_model_len=min(blocks * 16, arch.context_length)),
        # Host memory for three contexts: a load may take half of it (the prefetch share).
        cache=CacheConfig(
            num_kv_blocks=blocks, kv_host_gb=3 * blocks * per_block / (1 << 30), kv_disk_path=store,
            kv_write_policy="through", kv_load_timeout_s=120.0,
        ),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=max(2048, max_tokens)),
    )  # fmt: skip


def _first_token_s(core: EngineCore, rid: str, prompt: list[int]) -> tuple[float, float]:
    """Seconds from the request's arrival to its first token, and to the start of its first step (what it
    waited for its load before it could run)."""
    start = time.perf_counter()
    core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    admitted = None
    while core.has_unfinished():  # EngineCore.step, with the time its first step starts
        sched = core.schedule()
        if sched.is_empty:
            continue
        if admitted is None and any(c.request_id == rid for c in sched.chunks):
            admitted = time.perf_counter() - start
        if any(d.request_id == rid and d.new_token_ids for d in core.finish_step(sched, core.execute(sched))):
            elapsed = time.perf_counter() - start
            while core.has_unfinished():
                core.step()
            assert admitted is not None
            return elapsed, admitted
    raise RuntimeError(f"{rid} produced no token")


def measure_receive(
    loaded: LoadedModel, lengths: list[int], append: int, storage_gbps: float, repeats: int
) -> list[dict[str, Any]]:
    """Time to first token of a prompt whose stored context is loaded whole, or layer by layer (module doc)."""
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.arch.vocab_size
    rate = gbps_to_bytes_per_s(storage_gbps)
    runs: dict[tuple[str, int], list[tuple[float, float, float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="boundless-receive-") as store:
        link = ThrottledLink(Link("storage", rate), time.monotonic, time.sleep)
        core = EngineCore.from_model(loaded, _receive_config(loaded, store, max(lengths) + append), read_link=link)
        executor = core.executor
        assert isinstance(executor, ModelExecutor)
        kv_io = executor.kv_io
        _first_token_s(core, "warm", torch.randint(3, vocab, (64,)).tolist())
        for length in lengths:
            for r in range(repeats):
                for mode in ("whole", "layerwise"):  # interleaved: drifting load on the machine hits both alike
                    context = torch.randint(3, vocab, (length,), generator=generator).tolist()
                    new = torch.randint(3, vocab, (append,), generator=generator).tolist()
                    _first_token_s(core, f"write-{mode}-{length}-{r}", context)  # written through to the store
                    while core.has_work():  # its last blocks go to the writer at the next step
                        core.step()
                    kv_io.flush()
                    core.reset_prefix_cache()  # only the store has it now
                    kv_io.layerwise = mode == "layerwise"
                    before = core.stats().disk_io
                    ttft, admitted = _first_token_s(core, f"{mode}-{length}-{r}", context + new)
                    after = core.stats().disk_io
                    assert before is not None and after is not None
                    loaded_blocks = after.blocks_loaded - before.blocks_loaded
                    if loaded_blocks != length // 16:
                        raise RuntimeError(f"loaded {loaded_blocks} of {length // 16} stored blocks")
                    waited = after.layer_wait_s - before.layer_wait_s
                    runs.setdefault((mode, length), []).append((ttft, admitted, waited, loaded_blocks))
        executor.close()
    rows = []
    for (mode, length), xs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "whole")):
        ttft, admitted, waited = (statistics.median(x[i] for x in xs) for i in range(3))
        kv_bytes = xs[0][3] * core.layout.bytes_per_block
        # What the load added to the first token: the wait before the first step, and the forward's layer waits
        # (the prefill's compute is the rest).
        exposed = statistics.median(x[1] + x[2] for x in xs)
        rows.append(
            {"mode": mode, "context_tokens": length, "append_tokens": append, "kv_mb": round(kv_bytes / 1e6, 1),
             "link_s": kv_bytes / rate, "ttft_s": ttft, "admitted_s": admitted, "layer_wait_s": waited,
             "load_exposed_s": exposed}
        )  # fmt: skip
    return rows


def _pushed_first_token_s(
    pe: EngineCore, de: EngineCore, pe_net: ShmTransport, de_net: ShmTransport, rid: str, prompt: list[int]
) -> tuple[float, float, float, int]:
    """A DE-read call by hand (the dispatcher's moves): the DE loads the stored context and pushes it to the PE,
    which prefills. Seconds from the call to the push having landed on the PE, to the PE's first step of the
    request (its admission) and to its first token, and the blocks pushed."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tag = hash(rid) & 0xFFFFFF
    remote = pe.executor.remote  # type: ignore[attr-defined]
    received = remote.stats.streams_received
    start = time.perf_counter()
    landed: list[float] = []
    done = threading.Event()

    def watch() -> None:  # the push lands in the PE's receiver thread, maybe while the PE's forward pass runs
        while not done.is_set() and remote.stats.streams_received == received:
            time.sleep(0.001)
        landed.append(time.perf_counter() - start)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    answer = de.prepare_intake(rid, prompt, params, IntakePlan(pe_net.address, recv_tag=tag, push_tag=tag + 1))
    plan = HandoffPlan(de_net.address, tag, answer.send_from_block, tag + 1, answer.push_blocks, answer.push_from)
    pe.add_request(rid, prompt, params, handoff=plan)
    admitted = None
    while pe.has_unfinished():
        sched = pe.schedule()
        if not sched.is_empty:
            if admitted is None and any(c.request_id == rid for c in sched.chunks):
                admitted = time.perf_counter() - start
            pe.finish_step(sched, pe.execute(sched))
        de.step()
    ttft = time.perf_counter() - start
    de.abort(rid)
    while pe.kv.num_remote_in_flight or de.kv.num_remote_in_flight:
        pe.step()
        de.step()
    done.set()
    watcher.join()
    assert admitted is not None
    return landed[0], admitted, ttft, answer.push_blocks


# DE-read push modes (module doc): the DE's push whole or layerwise; with ``layerwise+pe`` the PE prefills as it lands.
PUSH_MODES = ("whole", "layerwise", "layerwise+pe")


def measure_push(
    loaded: LoadedModel, lengths: list[int], append: int, storage_gbps: float, net_gbps: float, repeats: int
) -> list[dict[str, Any]]:
    """DE-read: the DE's load pushed to the PE whole once loaded, or each layer as it crosses the DE's storage link
    (then its network link carries the push at the same time), the PE waiting for the whole push or (``layerwise+pe``)
    prefilling as its layers land (module doc)."""
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.arch.vocab_size
    runs: dict[tuple[str, int], list[tuple[float, float, float, float, int]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="boundless-push-") as store,
        tempfile.TemporaryDirectory(prefix="boundless-push-", dir="/dev/shm") as directory,
    ):
        config = _receive_config(loaded, store, max(lengths) + append)
        storage = ThrottledLink(Link("storage", gbps_to_bytes_per_s(storage_gbps)), time.monotonic, time.sleep)
        net = ThrottledLink(Link("net", gbps_to_bytes_per_s(net_gbps)), time.monotonic, time.sleep)
        pe, de = EngineCore.from_model(loaded, config), EngineCore.from_model(loaded, config, read_link=storage)
        pe_net, de_net = ShmTransport(directory, "pe"), ShmTransport(directory, "de")
        pe.connect(pe_net, throttle=net.transfer)
        de.connect(de_net, throttle=net.transfer)
        executor = de.executor
        assert isinstance(executor, ModelExecutor)
        for length in lengths:
            for r in range(repeats):
                for mode in PUSH_MODES:
                    context = torch.randint(3, vocab, (length,), generator=generator).tolist()
                    new = torch.randint(3, vocab, (append,), generator=generator).tolist()
                    _first_token_s(de, f"write-{mode}-{length}-{r}", context)
                    while de.has_work():
                        de.step()
                    executor.kv_io.flush()
                    de.reset_prefix_cache()
                    executor.kv_io.layerwise = mode != "whole"
                    pe.kv.layerwise_receive = de.kv.layerwise_receive = mode == "layerwise+pe"
                    waited = pe.executor.remote.stats.recv_layer_wait_s  # type: ignore[attr-defined]
                    landed, admitted, ttft, pushed = _pushed_first_token_s(
                        pe, de, pe_net, de_net, f"{mode}-{length}-{r}", context + new
                    )
                    waited = pe.executor.remote.stats.recv_layer_wait_s - waited  # type: ignore[attr-defined]
                    if pushed != length // 16:
                        raise RuntimeError(f"pushed {pushed} of {length // 16} stored blocks")
                    runs.setdefault((mode, length), []).append((landed, admitted, waited, ttft, pushed))
        pe_net.close()
        de_net.close()
    rows = []
    for (mode, length), xs in sorted(runs.items(), key=lambda kv: (kv[0][1], PUSH_MODES.index(kv[0][0]))):
        kv_bytes = xs[0][4] * pe.layout.bytes_per_block
        landed, admitted, waited, ttft = (statistics.median(x[i] for x in xs) for i in range(4))
        rows.append(
            {"mode": mode, "context_tokens": length, "append_tokens": append, "kv_mb": round(kv_bytes / 1e6, 1),
             "storage_s": kv_bytes / gbps_to_bytes_per_s(storage_gbps),
             "net_s": kv_bytes / gbps_to_bytes_per_s(net_gbps),
             "landed_s": landed, "admitted_s": admitted, "layer_wait_s": waited, "ttft_s": ttft}
        )  # fmt: skip
    return rows


def run_push(args: argparse.Namespace, loaded: LoadedModel, lengths: list[int]) -> None:
    rows = measure_push(loaded, lengths, args.append_tokens, args.storage_gbps, args.net_gbps, args.repeats)
    whole = {r["context_tokens"]: r["ttft_s"] for r in rows if r["mode"] == "whole"}
    print(
        f"{args.model}, DE-read: DE storage link {args.storage_gbps:g} Gbit/s, network {args.net_gbps:g} Gbit/s, "
        f"{args.append_tokens} new tokens, median of {args.repeats}"
    )
    print_table(
        ["push", "context", "KV MB", "storage s", "net s", "push landed s", "admitted s", "layer waits s", "TTFT s",
         "vs whole"],
        [
            [r["mode"], r["context_tokens"], r["kv_mb"], f"{r['storage_s']:.3f}", f"{r['net_s']:.3f}",
             f"{r['landed_s']:.3f}", f"{r['admitted_s']:.3f}", f"{r['layer_wait_s']:.3f}", f"{r['ttft_s']:.3f}",
             f"{r['ttft_s'] / whole[r['context_tokens']]:.2f}x"]
            for r in rows
        ],
    )  # fmt: skip
    if args.json:
        write_json(args.json, {"model": args.model, "storage_gbps": args.storage_gbps, "net_gbps": args.net_gbps,
                               "append_tokens": args.append_tokens, "rows": rows})  # fmt: skip


def run_receive(args: argparse.Namespace, loaded: LoadedModel, lengths: list[int]) -> None:
    rows = measure_receive(loaded, lengths, args.append_tokens, args.storage_gbps, args.repeats)
    whole = {r["context_tokens"]: r["ttft_s"] for r in rows if r["mode"] == "whole"}
    print(
        f"{args.model}, storage link {args.storage_gbps:g} Gbit/s, {args.append_tokens} new tokens, "
        f"median of {args.repeats}"
    )
    print_table(
        ["mode", "context", "KV MB", "link s", "admitted s", "layer waits s", "load exposed s", "TTFT s", "vs whole"],
        [
            [r["mode"], r["context_tokens"], r["kv_mb"], f"{r['link_s']:.3f}", f"{r['admitted_s']:.3f}",
             f"{r['layer_wait_s']:.3f}", f"{r['load_exposed_s']:.3f}", f"{r['ttft_s']:.3f}",
             f"{r['ttft_s'] / whole[r['context_tokens']]:.2f}x"]
            for r in rows
        ],
    )  # fmt: skip
    if args.json:
        write_json(
            args.json,
            {"model": args.model, "storage_gbps": args.storage_gbps, "append_tokens": args.append_tokens, "rows": rows},
        )


def run(args: argparse.Namespace) -> None:
    lengths = comma_numbers("--prompt-tokens", args.prompt_tokens, int, positive=True)  # (before the load)
    loaded = load_model(args.model)
    if args.receive and args.push:
        run_push(args, loaded, lengths)
        return
    if args.receive:
        run_receive(args, loaded, lengths)
        return
    rows = measure(loaded, lengths, args.net_gbps, args.repeats)
    print(f"{args.model}, net link {args.net_gbps:g} Gbit/s, median of {args.repeats}")
    print_table(
        ["mode", "prompt", "KV MB", "prefill s", "stream s", "exposed s", "ready s", "hidden"],
        [
            [r["mode"], r["prompt_tokens"], r["kv_mb"], f"{r['prefill_s']:.3f}", f"{r['stream_s']:.3f}",
             f"{r['exposed_s']:.3f}", f"{r['ready_s']:.3f}", f"{r['hidden']:.0%}"]
            for r in rows
        ],
    )  # fmt: skip
    if args.json:
        write_json(args.json, {"model": args.model, "net_gbps": args.net_gbps, "rows": rows})
