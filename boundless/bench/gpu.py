"""``boundless bench gpu``: the GPU path measured in one run, sized for a short lease of one GPU.

Nothing is downloaded: random checkpoints shaped like Llama-3.2-1B (written to disk, so that
transformers loads the same weights) and Llama-3.1-8B (drawn in GPU memory) stand in for the real
ones; speed does not depend on the values. In bf16 it runs

1. the device's ceilings: device-to-device copy bandwidth and a large bf16 matrix product;
2. ``bench offline`` against transformers' ``generate`` on the 1B shape: 256 x 128 in / 128 out,
   64 x 512 / 128 and 8 x 8,000 / 64;
3. how busy the GPU is during Boundless's decode-heavy run (kernel time under the profiler over wall
   time);
4. a batch-64 decode of the 8B shape against its weight-streaming roofline;
5. (``--shapes moe``) a mixture of experts shaped like gpt-oss-20b (its first 8 layers, MXFP4 experts) against
   transformers, the experts on the fused Triton kernels and held in MXFP4, and beside it eagerly and with the
   experts dequantized;
6. (``--shapes fp8``, ``int4``) the batch-64 decode of the 8B shape as an FP8 checkpoint (Qwen3-FP8's form: e4m3,
   a scale a block of 128 x 128) and as a 4-bit GPTQ one (groups of 128), each held as stored, against its own
   roofline (a half, a quarter of the weights' bytes) and, run with ``8b``, against the bf16 decode;

and writes every figure to ``--json``. Each part records its error and the run goes on, so one
failure does not cost the rest of the lease.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from boundless.bench.host_phases import PhaseRecorder, gaps_by_phase, overlaps
from boundless.bench.host_phases import split as split_phases
from boundless.bench.offline import BenchSystem, BoundlessSystem, HuggingFaceSystem, compare, make_prompts
from boundless.bench.report import output_path, print_table, write_json
from boundless.bench.timing import device_seconds
from boundless.config import positive_int
from boundless.llm import LLM, engine_config
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, random_weights, write_random_model

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SHAPES = {
    "llama-3.2-1b": TinySpec(
        kind="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
        weight_std=0.02, dtype="bfloat16",
    ),
    "llama-3.1-8b": TinySpec(
        kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, max_position_embeddings=131072, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
        weight_std=0.02, dtype="bfloat16",
    ),
    # gpt-oss-20b's widths (32 experts of 2,880, 4 a token, MXFP4; windows of 128 on every other layer), its first 8
    # layers of 24 (3.4 GB of experts to write and load within a lease; a step's time per layer is the whole one's).
    "gpt-oss-20b-8-layers": TinySpec(
        kind="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=8, num_heads=64,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=150000.0, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=2880, sliding_window=128, weight_std=0.02, dtype="bfloat16",
        mxfp4=True,
    ),
}  # fmt: skip
# (prompts, input tokens, output tokens) of the 1B comparison with transformers.
OFFLINE_CASES = [(256, 128, 128), (64, 512, 128), (8, 8000, 64)]
# ``--tiny``: the same run on small shapes, for checking the benchmark itself (on the CPU, in tests).
TINY_SHAPES = {
    "llama-3.2-1b": TinySpec(num_heads=4, num_kv_heads=2, tie_word_embeddings=True, dtype="bfloat16"),
    "llama-3.1-8b": TinySpec(num_heads=4, num_kv_heads=1, num_layers=3, dtype="bfloat16", seed=2),
}
TINY_CASES = [(4, 16, 8), (2, 40, 6), (1, 90, 4)]
TINY_SHAPES["gpt-oss-20b-8-layers"] = TinySpec(
    kind="gpt_oss", num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=8, mxfp4=True, dtype="bfloat16", seed=3
)
# (prompts, input tokens, output tokens) of the mixture's comparison: decode-heavy (every expert read each step), and
# longer prompts.
MOE_CASES = [(256, 128, 128), (64, 512, 128)]
TINY_MOE_CASES = [(4, 16, 8)]
# ``--shapes host``: a model that costs little next to the engine's Python for a step's batch.
HOST_PROXY_SPEC = TinySpec(vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=1)


def _stage(results: dict, name: str, fn: Callable[[], Any]) -> Any:
    """Run one part, recording its figures (or its error) and its seconds under ``name``."""
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        out = fn()
        results[name] = out
        # Printed as it comes, so a run cut short by its lease still leaves its figures in the log.
        print(json.dumps(out, default=str), flush=True)
        return out
    except Exception as e:  # one part failing must not cost the rest of the run
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {e}"}
        return None
    finally:
        results.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 2)
        print(f"== {name}: {time.perf_counter() - start:.1f} s", flush=True)


def measure_ceilings(device: torch.device) -> dict:
    """What this device moves and computes: a 4 GiB device-to-device copy (bytes read + written) and an
    8192^3 bf16 matrix product, on random data."""

    def copy_seconds() -> float:
        src = torch.randn(1 << 30, device=device)  # 4 GiB of fp32
        dst = torch.empty_like(src)
        return device_seconds(lambda: dst.copy_(src), device, 10)

    def matmul_seconds() -> float:
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        return device_seconds(lambda: a @ b, device, 10)

    copy_s = copy_seconds()
    mm_s = matmul_seconds()
    torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "copy_bytes_per_s": 2 * (1 << 32) / copy_s,
        "bf16_matmul_flops": 2 * 8192**3 / mm_s,
    }


def kernel_busy_fraction(fn: Callable[[], Any], core: Any = None) -> dict:
    """The share of ``fn``'s wall time during which a kernel or copy ran on the GPU: the union of the
    device activity intervals that the profiler records, over the wall time. With the ``EngineCore`` that ``fn``
    drives, also what its host was doing in the longest idle gaps, before the first kernel and after the last
    (``idle_gaps_host``, ``idle_before_host``, ``idle_after_host``: milliseconds of each engine phase)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    recorder = PhaseRecorder(core) if core is not None else None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # A marker kernel at a known host time puts the host's clock on the profiler's (to within a launch's latency).
        marked = time.perf_counter_ns()
        torch.ones(1, device="cuda")
        torch.cuda.synchronize()
        start_ns = time.perf_counter_ns()
        start = time.perf_counter()
        if recorder is not None:
            with recorder:
                fn()
        else:
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        end_ns = time.perf_counter_ns()
    named = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0:
            named.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    named.sort()
    marker = named.pop(0) if named else None  # (the first: nothing else was queued before it)
    spans = [(lo, hi) for lo, hi, _ in named]
    busy, gaps = merge_spans(spans)
    out = {
        "wall_s": wall, "busy_s": busy / 1e9, "busy_fraction": busy / 1e9 / wall, "gpu_events": len(spans),
        "top_kernels": _top_kernels(prof), **idle_gaps(gaps, wall - busy / 1e9),
        "timeline_sample": timeline_sample(named),
    }  # fmt: skip
    if recorder is not None and marker is not None and spans:
        offset = marker[0] - marked  # host ns to the profiler's
        first, last = spans[0][0], max(hi for _, hi in spans)
        phases = recorder.phases
        out["idle_gaps_host"] = gaps_by_phase(gaps, first, phases, offset)
        out["idle_before_host"] = overlaps(start_ns + offset, first, phases, offset)
        out["idle_after_host"] = overlaps(last, end_ns + offset, phases, offset)
    return out


def timeline_sample(events: list[tuple[int, int, str]], count: int = 250) -> list[list]:
    """``count`` consecutive GPU activities from the middle of a run (by time), each as [name, microseconds, idle
    microseconds before it since the activities before it ended]: a decode pass kernel by kernel, to see which
    kernels the idle time between them sits around. ``events``: (start ns, end ns, name), sorted."""
    if not events:
        return []
    middle = (events[0][0] + max(hi for _, hi, _ in events)) // 2
    first = next((i for i, (lo, _, _) in enumerate(events) if lo >= middle), len(events) - 1)
    ended = max(hi for _, hi, _ in events[:first]) if first else events[0][0]
    rows = []
    for lo, hi, name in events[first : first + count]:
        rows.append([name[:80], round((hi - lo) / 1e3, 1), round(max(0, lo - ended) / 1e3, 1)])
        ended = max(ended, hi)
    return rows


def merge_spans(spans: list[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """The time covered by the union of these (start, end) intervals (ns), and the gaps between them: (idle ns, when
    the gap began, ns after the first interval's start)."""
    spans = sorted(spans)
    busy, end = 0, None
    gaps: list[tuple[int, int]] = []
    for lo, hi in spans:
        if end is None or lo > end:
            if end is not None:
                gaps.append((lo - end, end - spans[0][0]))
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    return busy, gaps


def idle_gaps(gaps: list[tuple[int, int]], idle_s: float, limit: int = 10) -> dict:
    """Where the GPU's idle time lies between its first and last activity: the longest gaps (ms, and when each began,
    ms after the first activity), and how much of it is in gaps over a millisecond; the rest of ``idle_s`` (the wall
    time not busy) is before the first activity and after the last. Few long gaps are host work between phases (a
    prefill's inputs, the step after it); many short ones are the host's work between steps."""
    longest = sorted(gaps, reverse=True)[:limit]
    inside = sum(g for g, _ in gaps) / 1e9
    return {
        "idle_gaps_ms": [[round(g / 1e6, 2), round(at / 1e6, 1)] for g, at in longest],
        "idle_in_gaps_over_1ms_s": sum(g for g, _ in gaps if g > 1_000_000) / 1e9,
        "idle_by_gap_size": gap_sizes(gaps),
        "idle_between_s": inside,
        "idle_outside_s": idle_s - inside,
    }


# Gap sizes that say who made the gap: up to 10 us, the launch gap between a CUDA graph's kernels (or a stream's
# back-to-back launches); up to 100 us, eager launches the host barely keeps ahead of; up to 1 ms, host work between
# launches; over 1 ms, the host deciding or reading back with the GPU idle.
GAP_SIZES_NS = (("to_10us", 10_000), ("to_100us", 100_000), ("to_1ms", 1_000_000), ("over_1ms", None))


def gap_sizes(gaps: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    """The idle time between activities by the size of its gaps (:data:`GAP_SIZES_NS`): each class's gaps and their
    milliseconds. Many kernels each a few microseconds apart add up: a decode pass of ~170 kernels in a graph, 128
    passes."""
    out = {name: {"gaps": 0, "ms": 0.0} for name, _ in GAP_SIZES_NS}
    for g, _ in gaps:
        name = next(name for name, bound in GAP_SIZES_NS if bound is None or g <= bound)
        out[name]["gaps"] += 1
        out[name]["ms"] += g / 1e6
    for row in out.values():
        row["ms"] = round(row["ms"], 3)
    return out


def _top_kernels(prof: Any, limit: int = 15) -> list[dict]:
    """The kernels that took the most GPU time under the profiler: where the next speed-up is."""
    rows = []
    for e in prof.key_averages():
        self_us: float | None = getattr(e, "self_device_time_total", None)
        if self_us is None:
            self_us = float(getattr(e, "self_cuda_time_total", 0))
        if self_us > 0:
            rows.append({"kernel": e.key[:120], "calls": e.count, "gpu_ms": round(self_us / 1e3, 3)})
    return sorted(rows, key=lambda r: -r["gpu_ms"])[:limit]


def _default_len(args: argparse.Namespace) -> int:
    """``--max-model-len`` unless given: the tiny shapes' context is 2,048 tokens, under the full ones' 8,192."""
    return 512 if args.tiny else 8192


def _engine_config(
    path: Path,
    args: argparse.Namespace,
    max_num_seqs: int,
    num_scheduler_steps: int = 1,
    async_scheduling: bool = False,
    enforce_eager: bool = False,
):
    return engine_config(
        str(path), dtype="bfloat16", device=args.device, max_model_len=args.max_model_len or _default_len(args),
        kv_cache_gb=args.kv_cache_gb, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max_num_seqs,
        swap_space_gb=0.0, attention_backend=args.attention_backend, num_scheduler_steps=num_scheduler_steps,
        async_scheduling=async_scheduling, flash_prefill=args.flash_prefill, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, enforce_eager=enforce_eager,
    )  # fmt: skip


def bench_small_shape(args: argparse.Namespace, results: dict, root: Path) -> None:
    """The 1B shape against transformers, and how busy the GPU is during Boundless's decode-heavy run."""
    spec = (TINY_SHAPES if args.tiny else SHAPES)["llama-3.2-1b"]
    path = _stage(results, "write_1b", lambda: str(write_random_model(root / "llama-1b", spec, device=args.device)))
    if path is None:
        return
    loaded = load_model(path, dtype="bfloat16", device=args.device, quantization=args.quantization)
    systems = [
        HuggingFaceSystem(loaded),
        BoundlessSystem(LLM.from_config(_engine_config(Path(path), args, 256), loaded)),
    ]
    cases = (TINY_CASES if args.tiny else OFFLINE_CASES)[: args.cases]
    for n, i, o in cases:
        prompts = make_prompts(loaded, n, i, seed=0)
        _stage(
            results,
            f"offline_1b_{n}x{i}x{o}",
            functools.partial(compare, systems, prompts, o, args.repeats, len(prompts), o),
        )
    n, i, o = cases[0]
    prompts = make_prompts(loaded, n, i, seed=0)
    ours = systems[1]
    assert isinstance(ours, BoundlessSystem)
    if loaded.device.type == "cuda":
        _stage(results, "busy_1b", lambda: kernel_busy_fraction(lambda: ours.generate(prompts, o), ours.llm.engine))
    _stage(results, "host_split_1b", lambda: host_split(ours, prompts, o))
    _stage(results, "host_profile_1b", lambda: host_profile(lambda: ours.generate(prompts, o)))
    systems.clear()

    def hf_rate(n: int, i: int, o: int) -> float | None:
        figures = (results.get(f"offline_1b_{n}x{i}x{o}") or {}).get("figures", [])
        return next((f["output_tokens_per_s"] for f in figures if f["system"] == "huggingface"), None)

    windows = _windows(args)
    # The same decode-heavy case with multi-step decoding: the scheduler and the deltas once per window, its passes
    # back to back on the device (CUDA graphs); the largest window also with asynchronous scheduling (the next window
    # decided and queued while one runs), on every case; and single steps with it (each a window of one pass).
    for window, ahead in [*_window_runs(windows), (1, True)]:
        config = _engine_config(Path(path), args, 256, window, async_scheduling=ahead)
        windowed = BoundlessSystem(LLM.from_config(config, loaded))
        for case in cases if ahead and window > 1 else cases[:1]:
            case_prompts = prompts if case == cases[0] else make_prompts(loaded, case[0], case[1], seed=0)
            key = f"{_run_name(window, ahead)}_1b_{'x'.join(map(str, case))}"
            _stage(
                results,
                key,
                functools.partial(measured_alone, windowed, case_prompts, case[2], args.repeats, hf_rate(*case)),
            )
            largest = bool(windows) and window == max(windows)
            if ahead and window > 1 and case in (cases[0], cases[-1]):
                # The same with only windows decided ahead (the rule before steps with prefill were): in this run, so
                # the two compare on one machine (the decode-heavy and the long-prompt cases: #16's targets).
                windowed.llm.engine.scheduler.decide_steps_ahead = False
                alone = functools.partial(measured_alone, windowed, case_prompts, case[2], args.repeats, hf_rate(*case))
                _stage(results, f"{key}_windows_only", alone)
                windowed.llm.engine.scheduler.decide_steps_ahead = True
            if largest and loaded.device.type == "cuda" and (ahead or case == cases[0]):
                # (Every case with asynchronous scheduling: where the long prompts' time goes, too.)
                _stage(
                    results,
                    f"busy_{key}",
                    functools.partial(
                        kernel_busy_fraction,
                        functools.partial(windowed.generate, case_prompts, case[2]),
                        windowed.llm.engine,
                    ),
                )
            if largest and case == cases[0]:
                _stage(results, f"host_split_{key}", functools.partial(host_split, windowed, prompts, o))


def bench_moe_shape(args: argparse.Namespace, results: dict, root: Path) -> None:
    """The gpt-oss-shaped mixture against transformers (its experts dequantized to bfloat16, its own loop over them):
    ours with the experts held in MXFP4 on the fused kernels and CUDA graphs (the default on CUDA); then on the first
    case, against the same baseline, ours eagerly (no graphs) and ours with the experts dequantized to bfloat16."""
    spec = (TINY_SHAPES if args.tiny else SHAPES)["gpt-oss-20b-8-layers"]
    path = _stage(results, "write_moe", lambda: str(write_random_model(root / "gpt-oss", spec, device=args.device)))
    if path is None:
        return
    loaded = load_model(path, dtype="bfloat16", device=args.device)
    moe = loaded.model.layers[0].moe
    results["moe_experts_in_mxfp4"] = moe is not None and moe.held == "mxfp4"
    hf: HuggingFaceSystem | None = None
    try:
        hf = HuggingFaceSystem(loaded)
    except Exception as e:  # (the baseline failing to load must not cost ours)
        traceback.print_exc()
        results["hf_moe"] = {"error": f"{type(e).__name__}: {e}"}
    ours = BoundlessSystem(LLM.from_config(_engine_config(Path(path), args, 256), loaded))
    cases = TINY_MOE_CASES if args.tiny else MOE_CASES
    for n, i, o in cases:
        prompts = make_prompts(loaded, n, i, seed=0)
        systems: list[BenchSystem] = [ours] if hf is None else [hf, ours]
        _stage(results, f"offline_moe_{n}x{i}x{o}", functools.partial(compare, systems, prompts, o, args.repeats, n, o))
    n, i, o = cases[0]
    figures = (results.get(f"offline_moe_{n}x{i}x{o}") or {}).get("figures", [])
    hf_rate = next((f["output_tokens_per_s"] for f in figures if f["system"] == "huggingface"), None)
    del hf, ours
    gc.collect()  # (the baseline's weights and the first engine's KV pool go before the next engines take theirs)
    prompts = make_prompts(loaded, n, i, seed=0)
    eager = BoundlessSystem(LLM.from_config(_engine_config(Path(path), args, 256, enforce_eager=True), loaded))
    _stage(
        results, f"eager_moe_{n}x{i}x{o}", functools.partial(measured_alone, eager, prompts, o, args.repeats, hf_rate)
    )
    del eager
    gc.collect()
    dense = load_model(path, dtype="bfloat16", device=args.device, quantized_experts=False)
    dequantized = BoundlessSystem(LLM.from_config(_engine_config(Path(path), args, 256), dense))
    _stage(
        results,
        f"dequantized_moe_{n}x{i}x{o}",
        functools.partial(measured_alone, dequantized, prompts, o, args.repeats, hf_rate),
    )


def measured_alone(
    system: BoundlessSystem, prompts: list[list[int]], output_len: int, repeats: int, baseline_rate: float | None
) -> dict:
    """Boundless alone on a case already measured against the baseline (``compare`` with one system: the same
    warm-up on the whole case and medians), its output tokens per second, and the ratio to the baseline's rate from
    that measurement."""
    result = compare([system], prompts, output_len, repeats, len(prompts), output_len)
    rate = result["figures"][0]["output_tokens_per_s"]
    result["output_tokens_per_s"] = rate
    result["ratio_to_baseline"] = rate / baseline_rate if baseline_rate else None
    return result


def host_split(system: BoundlessSystem, prompts: list[list[int]], output_len: int) -> dict:
    """Where a run's wall time goes, step by step: deciding steps (``EngineCore.schedule``, and ``schedule_ahead``
    with asynchronous scheduling), running them (``execute``: launching a step, which builds the inputs, runs the
    forward pass and samples, and waiting for a window on the device; ``wait_s`` is that wait alone) and applying
    their tokens (``finish_step``: outputs, stops, text). Seconds in all, and per step."""
    core = system.llm.engine
    with PhaseRecorder(core) as phases:
        before = core.counters.steps
        start = time.perf_counter()
        system.generate(prompts, output_len)
        wall = time.perf_counter() - start
    return split_phases(phases, wall, core.counters.steps - before)


def host_profile(fn: Callable[[], Any], limit: int = 40) -> dict:
    """The run under ``cProfile``: the functions that took the most time of their own (the profiler slows Python
    down, the shares hold)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(limit)
    return {"top_tottime": text.getvalue()}


def weight_stream_bytes(loaded: LoadedModel) -> int:
    """Bytes a decode step must read of the weights: every layer (as held: a byte an element in e4m3 with
    ``--quantization fp8``, with the scales of its rows; a quantized checkpoint's held as stored, with its scales and
    zero points), the final norm and the LM head (the embedding is only
    gathered, a row per sequence, unless it is also the head)."""
    model = loaded.model
    total = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    scales = (
        getattr(layer, f"{name}_scale", None) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")
    )
    # (``--quantization fp8``'s scales; an FP8 checkpoint's held as stored are parameters, counted above.)
    total += sum(
        s.numel() * s.element_size() for s in scales if s is not None and not isinstance(s, torch.nn.Parameter)
    )
    total += model.norm.weight.numel() * model.norm.weight.element_size()
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head
    return total + head.numel() * head.element_size()


def decode_roofline(args: argparse.Namespace, results: dict, root: Path, held: str | None = None) -> dict:
    """Batch-64 decode of the 8B shape: seconds per decode step against the weight-streaming roofline. ``held``: the
    shape as a quantized checkpoint whose projections are held as stored, ``fp8`` e4m3 with a scale a block (128 x
    128; the tiny shape's 16 x 16: the block kernel's products) or ``int4`` GPTQ's 4 bits in groups of 128 (16:
    ``held_linear``'s); its bytes, and so its roofline, about a half or a quarter."""
    spec = (TINY_SHAPES if args.tiny else SHAPES)["llama-3.1-8b"]
    size = 16 if args.tiny else 128
    if held == "fp8":
        spec = dataclasses.replace(spec, fp8_block=(size, size))
    elif held == "int4":
        spec = dataclasses.replace(spec, gptq_group=size)
    name = f"llama-8b-{held}" if held else "llama-8b"
    path = write_random_model(root / name, spec, weights=False)  # config and tokenizer only
    loaded = load_model(
        str(path), "bfloat16", args.device, weights=(f"random-{name}", random_weights(spec, args.device)),
        quantization=args.quantization, quantized_dense=True if held else None,
    )  # fmt: skip
    batch, input_len, output_len = (4, 16, 8) if args.tiny else (64, 128, 128)
    prompts = make_prompts(loaded, batch, input_len, seed=0)

    def decode_step(window: int, ahead: bool) -> tuple[float, float, float]:
        """Seconds of the prefill, of the whole run and of one decode step (the run less the prefill, over the
        steps after the first token): medians of ``--repeats`` runs each."""
        gc.collect()  # (an engine before this one is garbage: its KV pool goes before this one's is taken)
        ours = BoundlessSystem(LLM.from_config(_engine_config(path, args, 64, window, ahead), loaded))
        ours.generate(prompts, 4)  # the whole batch: every kernel its steps take is compiled before the timed runs

        def seconds(tokens: int) -> float:
            runs = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                outputs = ours.generate(prompts, tokens)
                runs.append(time.perf_counter() - start)
                assert all(len(o) == tokens for o in outputs)
            return sorted(runs)[len(runs) // 2]

        prefill_s, total_s = seconds(1), seconds(output_len)
        return prefill_s, total_s, (total_s - prefill_s) / (output_len - 1)

    prefill_s, total_s, step_s = decode_step(1, False)
    # The same decode in windows (the largest --windows) decided ahead: the host's work per step off the GPU's path.
    windows = _windows(args)
    windowed = decode_step(max(windows), True)[2] if windows else None
    arch = loaded.arch
    kv_element = 1 if args.kv_cache_dtype.startswith("fp8") else 2  # (--kv-cache-dtype fp8: a byte an element)
    kv_per_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * kv_element
    kv_bytes = batch * (input_len + output_len / 2) * kv_per_token  # context read per step, on average
    weights = weight_stream_bytes(loaded)
    ceilings = results.get("ceilings") or {}
    bandwidth = ceilings.get("copy_bytes_per_s") or 4.8e12
    roofline_s = (weights + kv_bytes) / bandwidth
    out = {
        "batch": batch, "input_len": input_len, "output_len": output_len, "prefill_s": prefill_s,
        "total_s": total_s, "decode_step_s": step_s, "weight_bytes": weights, "kv_bytes_per_step": kv_bytes,
        "bandwidth_bytes_per_s": bandwidth, "roofline_step_s": roofline_s, "step_over_roofline": step_s / roofline_s,
        "decode_tokens_per_s": batch / step_s,
    }  # fmt: skip
    if held:
        layer = loaded.model.layers[0]
        out["held_as"] = f"fp8 blocks of {layer.fp8_block}" if held == "fp8" else f"(bits, group) {layer.int_form}"
        bf16 = (results.get("decode_8b") or {}).get("decode_step_s")
        out["speedup_over_bf16"] = bf16 / step_s if bf16 else None
    if windowed is not None:
        key = f"{_run_name(max(windows), True)}_decode_step_s"
        out |= {key: windowed, f"{key.removesuffix('_decode_step_s')}_step_over_roofline": windowed / roofline_s}
    return out


def host_proxy(args: argparse.Namespace, root: Path) -> dict:
    """The engine's host work on the decode-heavy case's batch (256 x 128 in / 128 out; ``--tiny``: its first tiny
    case) with a one-layer model 64 wide, on the device asked: on the CPU the model then costs little, and what is
    left is mostly the engine's Python per step, which on a GPU runs between its kernels. For a single step and each
    ``--windows`` window, and the largest with asynchronous scheduling: the wall time and its split among the engine's
    phases (the median of ``--repeats`` runs, after a whole-batch warm-up)."""
    path = write_random_model(root / "host-proxy", HOST_PROXY_SPEC)
    loaded = load_model(str(path), device=args.device)
    n, i, o = (TINY_CASES if args.tiny else OFFLINE_CASES)[0]
    prompts = make_prompts(loaded, n, i, seed=0)
    splits = {}
    for window, ahead in [(1, False), *_window_runs(_windows(args))]:
        config = engine_config(
            str(path), device=args.device, max_model_len=2 * (i + o), max_num_seqs=n, max_num_batched_tokens=n * i,
            num_scheduler_steps=window, swap_space_gb=0.0, attention_backend=args.attention_backend,
            async_scheduling=ahead,
        )  # fmt: skip
        system = BoundlessSystem(LLM.from_config(config, loaded))
        system.generate(prompts, 4)
        runs = sorted((host_split(system, prompts, o) for _ in range(args.repeats)), key=lambda r: r["wall_s"])
        key = _run_name(window, ahead)
        splits[key] = runs[len(runs) // 2]
        print(json.dumps({f"host_proxy_{key}": splits[key]}), flush=True)
    return splits


def _window_runs(windows: list[int]) -> list[tuple[int, bool]]:
    """(scheduler steps, asynchronous scheduling) of each windowed run: every window, then the largest again with
    asynchronous scheduling."""
    return [(w, False) for w in windows] + ([(max(windows), True)] if windows else [])


def _run_name(window: int, ahead: bool) -> str:
    return f"{'async_' if ahead else ''}window{window}"


def _windows(args: argparse.Namespace) -> list[int]:
    try:
        return [w for w in (int(x) for x in args.windows.split(",") if x.strip()) if w > 1]
    except ValueError:
        raise SystemExit(f"--windows: numbers of scheduler steps separated by commas, not {args.windows!r}") from None


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    shapes = {s.strip() for s in args.shapes.split(",") if s.strip()}
    if unknown := shapes - {"host", "1b", "8b", "tiles", "moe", "fp8", "int4"}:
        raise SystemExit(f"--shapes: unknown {', '.join(sorted(unknown))}; host, 1b, 8b, tiles, moe, fp8 or int4")
    _windows(args)  # (a bad --windows stops the run before anything is built)
    if device.type == "cuda" and not torch.cuda.is_available():  # (else each stage failed, and the run exited 0)
        raise SystemExit(
            f"--device {args.device}: CUDA is not available here; --device cpu runs --tiny or --shapes host on the CPU"
        )
    if device.type != "cuda" and not args.tiny and not shapes <= {"host"}:
        raise SystemExit(
            "bench gpu needs a CUDA device (or --tiny, which checks the benchmark on small shapes; or --shapes host)"
        )
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": vars(args) | {"func": None}}
    if device.type == "cuda":
        _stage(results, "ceilings", lambda: measure_ceilings(device))
    if "host" in shapes:
        _stage(results, "host_proxy", lambda: host_proxy(args, root))
    if "1b" in shapes:
        bench_small_shape(args, results, root)
        gc.collect()  # its models are garbage now: free their GPU memory for the next shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "8b" in shapes:
        _stage(results, "decode_8b", lambda: decode_roofline(args, results, root))
    for held in ("fp8", "int4"):
        if held in shapes:
            gc.collect()  # (the 8B model before is garbage now: its bytes go before this one's are taken)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            _stage(results, f"decode_8b_{held}", functools.partial(decode_roofline, args, results, root, held))
    if "moe" in shapes:
        _stage(results, "moe", lambda: bench_moe_shape(args, results, root))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "tiles" in shapes:
        from boundless.bench import attention_tiles

        dtype = torch.float32 if args.tiny and device.type != "cuda" else torch.bfloat16
        sweep = attention_tiles.sweep
        for case in attention_tiles.cases(args.tiny)[1]:  # (a stage each: a run cut short keeps the cases done)
            _stage(
                results,
                f"tiles_{case.name}",
                functools.partial(sweep, case, device, dtype, args.tiny, args.repeats, args.tiles_grid == "small"),
            )
    write_json(args.json, results)
    _summary(results)
    return results


def _summary(results: dict) -> None:
    rows = []
    for key, value in results.items():
        if key.startswith("offline_") and isinstance(value, dict) and "throughput_ratio" in value:
            figs = {f["system"]: f for f in value["figures"]}
            hf, ours = figs["huggingface"], figs["boundless"]
            rows.append([
                key, f"{hf['output_tokens_per_s']:.0f}", f"{ours['output_tokens_per_s']:.0f}",
                f"{value['throughput_ratio']:.2f}x", f"{value['single_decode_ratio']:.2f}x",
            ])  # fmt: skip
    if rows:
        print_table(["case", "hf tok/s", "boundless tok/s", "throughput", "single decode"], rows)
    busy = results.get("busy_1b") or {}
    if "busy_fraction" in busy:
        print(f"GPU busy during the decode-heavy run: {busy['busy_fraction']:.1%} of {busy['wall_s']:.2f} s")
        for row in busy.get("top_kernels", []):
            print(f"  {row['gpu_ms']:10.3f} ms {row['calls']:7d} x  {row['kernel']}")
    splits = {k: v for k, v in results.items() if k.startswith("host_split")}
    splits.update({f"host_proxy_{k}": v for k, v in (results.get("host_proxy") or {}).items() if isinstance(v, dict)})
    for key, split in splits.items():
        if isinstance(split, dict) and "steps" in split:
            print(
                f"{key}, per step: schedule {split['schedule_ms_per_step']:.2f} ms, execute "
                f"{split['execute_ms_per_step']:.2f} ms, finish_step {split['finish_step_ms_per_step']:.2f} ms "
                f"({split['steps']} steps in {split['wall_s']:.2f} s)"
            )
    for key, value in results.items():
        if key.startswith(("window", "async_window")) and isinstance(value, dict) and "output_tokens_per_s" in value:
            ratio = value["ratio_to_baseline"]
            versus = f", {ratio:.2f}x transformers" if ratio else ""
            print(f"{key}: {value['output_tokens_per_s']:.0f} tok/s{versus}")
        if key.startswith(("busy_window", "busy_async")) and isinstance(value, dict) and "busy_fraction" in value:
            gaps = ", ".join(f"{g} ms at {at} ms" for g, at in value.get("idle_gaps_ms", [])[:4])
            print(
                f"{key}: GPU busy {value['busy_fraction']:.1%} of {value['wall_s']:.2f} s; idle before and after "
                f"{value.get('idle_outside_s', 0) * 1e3:.0f} ms, between {value.get('idle_between_s', 0) * 1e3:.0f} ms "
                f"(longest: {gaps})"
            )
            sizes = value.get("idle_by_gap_size", {})
            if sizes:
                print("  between, by gap size: " + ", ".join(
                    f"{name.replace('_', ' ')} {row['ms']:.1f} ms in {row['gaps']}" for name, row in sizes.items()
                ))  # fmt: skip
            # What the host did meanwhile.
            spans = [(f"the {g['ms']} ms at {g['at_ms']} ms", g["host"]) for g in value.get("idle_gaps_host", [])[:3]]
            spans += [
                (f"idle {w} the kernels", value[f"idle_{w}_host"])
                for w in ("before", "after")
                if f"idle_{w}_host" in value
            ]
            for what, host in spans:
                print(f"  {what}, the host's (ms): " + ", ".join(f"{n} {ms:.1f}" for n, ms in list(host.items())[:3]))
    for key, value in results.items():
        if (
            key.startswith(("eager_moe", "dequantized_moe"))
            and isinstance(value, dict)
            and "output_tokens_per_s" in value
        ):
            ratio = value["ratio_to_baseline"]
            versus = f", {ratio:.2f}x transformers" if ratio else ""
            print(f"{key}: {value['output_tokens_per_s']:.0f} tok/s{versus}")
    if "moe_experts_in_mxfp4" in results:
        print(f"the mixture's experts held in MXFP4: {results['moe_experts_in_mxfp4']}")
    dec = results.get("decode_8b") or {}
    for held in ("fp8", "int4"):
        fig = results.get(f"decode_8b_{held}") or {}
        if "decode_step_s" in fig:
            versus = f", {fig['speedup_over_bf16']:.2f}x the bf16 decode" if fig.get("speedup_over_bf16") else ""
            print(
                f"8B batch-64 decode, {held} checkpoint held as stored ({fig['held_as']}): "
                f"{fig['decode_step_s'] * 1e3:.2f} ms per step, roofline {fig['roofline_step_s'] * 1e3:.2f} ms "
                f"({fig['step_over_roofline']:.2f}x){versus}"
            )
    if "decode_step_s" in dec:
        print(
            f"8B batch-64 decode: {dec['decode_step_s'] * 1e3:.2f} ms per step, roofline "
            f"{dec['roofline_step_s'] * 1e3:.2f} ms ({dec['step_over_roofline']:.2f}x), "
            f"{dec['decode_tokens_per_s']:.0f} tok/s"
        )
        for key, value in dec.items():
            if key.endswith("_decode_step_s"):
                name = key.removesuffix("_decode_step_s")
                print(
                    f"8B batch-64 decode, {name}: {value * 1e3:.2f} ms per step "
                    f"({dec[f'{name}_step_over_roofline']:.2f}x the roofline)"
                )
    tiles = {k.removeprefix("tiles_"): v for k, v in results.items() if k.startswith("tiles_") and "error" not in v}
    if tiles:
        from boundless.bench.attention_tiles import summary_rows

        print(
            "attention, one layer (ms): the default tiles, the fastest giving the same output, FlexAttention, SDPA, "
            "FlashAttention's variable-length kernel as --flash-prefill calls it; at pages of 64: the "
            "default tiles, FlexAttention"
        )
        headers = ["case", "default", "fastest", "its tiles", "flex", "sdpa", "flash", "default p64", "flex p64"]
        print_table(headers, summary_rows(tiles))
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    if errors:
        print("errors: " + json.dumps(errors))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--shapes",
        default="1b,8b",
        help="which shapes: 1b (against transformers), 8b (decode), host (the engine's host work on a tiny model: "
        "any device), tiles (the attention kernels' tile shapes swept on the 1B shape's attention), moe (a "
        "gpt-oss-shaped mixture with MXFP4 experts against transformers), fp8 and int4 (the 8B decode as an FP8 "
        "checkpoint held in blocks, a 4-bit GPTQ one held in its bits; with 8b, against the bf16 one)",
    )
    parser.add_argument(
        "--cases", type=positive_int, default=len(OFFLINE_CASES), help="how many of the 1B cases to run"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs per system (medians: a first run on a GPU runs cold)",
    )
    parser.add_argument("--workdir", default="/tmp/boundless-bench-gpu", help="where the random checkpoints go")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default 8192 (the --tiny shapes: 512, within their context)"
    )
    parser.add_argument("--kv-cache-gb", type=float, default=16.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, default="bench-gpu.json", help="write the figures here"
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (triton on CUDA, else torch), torch or triton (the GPU kernels)",
    )
    parser.add_argument(
        "--flash-prefill",
        action="store_true",
        help="the engines with --flash-prefill (prefill chunks on FlashAttention's variable-length kernel)",
    )
    parser.add_argument(
        "--windows",
        default="8,16",
        help="also run the decode-heavy case with each of these numbers of scheduler steps (empty: not)",
    )
    parser.add_argument(
        "--tiles-grid",
        choices=("full", "small"),
        default="full",
        help="--shapes tiles: every tile shape of the grid, or the default and five neighbours a kind of case",
    )
    parser.add_argument(
        "--quantization", default=None, help="fp8: Boundless's layers in FP8 (transformers' stay in bfloat16)"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="Boundless's KV cache type: auto (bfloat16) or fp8")
    parser.add_argument("--tiny", action="store_true", help="small shapes, to check the benchmark itself (CPU too)")


def main() -> None:
    """``python -m boundless.bench.gpu``: the same as ``boundless bench gpu``, importing only the engine
    (a GPU machine may lack the server's packages)."""
    parser = argparse.ArgumentParser(prog="python -m boundless.bench.gpu", description=__doc__.split("\n")[0])
    add_arguments(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
