"""``boundless bench offline``: Hugging Face ``generate`` and Boundless on the same prompts, side by side."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import torch

from boundless.bench.report import print_table, write_json
from boundless.config import engine_config_from_flags, positive_int
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM
from boundless.model.loader import LoadedModel, hf_config, load_configured_model

T = TypeVar("T")


@dataclass
class OfflineFigures:
    system: str
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    single_decode_tokens_per_s: float


def make_prompts(loaded: LoadedModel, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Random token ids of exactly ``input_len``, avoiding special tokens (equal lengths: no padding advantage)."""
    g = torch.Generator().manual_seed(seed)
    special = set(loaded.tokenizer.all_special_ids)
    allowed = torch.tensor([t for t in range(loaded.arch.vocab_size) if t not in special])
    return [allowed[torch.randint(len(allowed), (input_len,), generator=g)].tolist() for _ in range(num_prompts)]


HF_ATTENTION = "sdpa"  # transformers' attention implementation in the comparison (PyTorch's fused kernels)
# Models whose attention PyTorch's fused kernels cannot compute (Gemma 2's soft cap of the scores, gpt-oss's sinks): its
# eager attention.
HF_EAGER_ARCHITECTURES = ("gemma2", "gpt_oss")


def load_hf_reference(loaded: LoadedModel):
    """The same weights in transformers (dequantized from the same GGUF when the model is one), with
    :data:`HF_ATTENTION` attention (eager for :data:`HF_EAGER_ARCHITECTURES`)."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise SystemExit("bench offline compares against transformers: pip install 'boundless-serve[test]'") from e
    transformers.logging.set_verbosity_error()
    path = loaded.path
    eager = loaded.arch.model_type in HF_EAGER_ARCHITECTURES
    options = {"dtype": loaded.dtype, "attn_implementation": "eager" if eager else HF_ATTENTION}
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **options)
    else:
        if loaded.hf_overrides:  # (--hf-overrides: transformers' config made from the same keys)
            config = hf_config(path, loaded.hf_overrides)
            options["config"] = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        if (hf_config(path).get("quantization_config") or {}).get("quant_method") == "mxfp4":
            # (gpt-oss's MXFP4 experts dequantized: transformers' MXFP4 kernels come from the Hub, and need a GPU)
            options["quantization_config"] = transformers.Mxfp4Config(dequantize=True)  # type: ignore[attr-defined]
        model = AutoModelForCausalLM.from_pretrained(str(path), **options)
    # (transformers decorates PreTrainedModel.to with functools.wraps, which mypy does not bind as a method.)
    return model.to(loaded.device).eval()  # type: ignore[arg-type]


def hf_generate(model, prompts: list[list[int]], output_len: int, pad_id: int, device: torch.device) -> list[list[int]]:
    """Batched greedy ``generate``, left-padded, exactly ``output_len`` new tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(args: argparse.Namespace) -> dict:
    config = engine_config_from_flags(args)
    loaded = load_configured_model(config.model)
    prompts = make_prompts(loaded, args.num_prompts, args.input_len, args.bench_seed)
    systems: list[BenchSystem] = [BoundlessSystem(LLM.from_config(config, loaded))]
    if not args.skip_hf:
        systems.insert(0, HuggingFaceSystem(loaded))
    result = {"model": config.model.model, "dtype": config.model.dtype, "device": config.model.device}
    result.update(compare(systems, prompts, args.output_len, args.repeats))
    if loaded.arch.model_type in HF_EAGER_ARCHITECTURES:
        result["hf_attention"] = "eager"  # (load_hf_reference's, for a model whose scores transformers caps)
    if args.json:
        write_json(args.json, result)
    return result


def compare(
    systems: list[BenchSystem],
    prompts: list[list[int]],
    output_len: int,
    repeats: int,
    warm_up_prompts: int = 2,
    warm_up_tokens: int = 4,
) -> dict:
    """Run the systems on the same prompts, taking turns (the first to run alternates, so a slow spell
    of a noisy machine or a warm cache favours neither), print the table and the ratio, return the figures.
    Each first generates ``warm_up_tokens`` tokens for the first ``warm_up_prompts`` prompts (on a GPU, the whole
    case: a first run there took transformers 4-5x its later runs and Boundless 1.3-2.6x, after a warm-up of 4
    tokens of the whole batch)."""
    for sys_ in systems:
        sys_.generate(prompts[:warm_up_prompts], warm_up_tokens)
    runs: list[dict[str, _Run]] = []
    for turn in range(repeats):
        order = systems[turn % len(systems) :] + systems[: turn % len(systems)]
        runs.append({sys_.name: sys_.measure(prompts, output_len) for sys_ in order})
        gc.collect()
    figures = [_median_figures(sys_.name, [r[sys_.name] for r in runs]) for sys_ in systems]
    result: dict = {
        "threads": torch.get_num_threads(),
        "num_prompts": len(prompts),
        "input_len": len(prompts[0]),
        "output_len": output_len,
        "repeats": repeats,
        "hf_attention": HF_ATTENTION,
        "figures": [asdict(f) for f in figures],
        "runs": [
            {name: {"seconds": r.seconds, "output_tokens": r.output_tokens, "single_decode_tokens_per_s": r.single}
                   | r.details
             for name, r in run.items()}
            for run in runs
        ],
    }  # fmt: skip
    rows = [
        [f.system, f"{f.output_tokens_per_s:.1f}", f"{f.seconds:.2f}", f"{f.single_decode_tokens_per_s:.1f}"]
        for f in figures
    ]
    if repeats > 1:
        print(f"medians of {repeats} runs each, the systems taking turns:")
    print_table(["system", "output tok/s", "seconds", "single-request decode tok/s"], rows)
    if repeats > 1:  # (a first run slower than the rest: whether the collector's work was the difference)
        for sys_ in systems:
            times = [(r[sys_.name].seconds, r[sys_.name].details["gc_s"]) for r in runs]
            print(f"{sys_.name}'s runs: " + ", ".join(f"{s:.2f} s (collector {gc_s:.2f} s)" for s, gc_s in times))
    if len(figures) == 2:
        hf_fig, ours = figures
        result["throughput_ratio"] = ours.output_tokens_per_s / hf_fig.output_tokens_per_s
        result["single_decode_ratio"] = ours.single_decode_tokens_per_s / hf_fig.single_decode_tokens_per_s
        first = runs[0]  # greedy: every run generates the same tokens
        same = sum(a == b for a, b in zip(first["boundless"].outputs, first["huggingface"].outputs, strict=True))
        result["identical_outputs"] = same
        print(
            f"ratio (boundless / huggingface): throughput {result['throughput_ratio']:.2f}x, "
            f"single-request decode {result['single_decode_ratio']:.2f}x; "
            f"greedy outputs identical for {same}/{len(prompts)} prompts"
        )
        if repeats > 1:
            per_run = [
                (r["boundless"].output_tokens / r["boundless"].seconds)
                / (r["huggingface"].output_tokens / r["huggingface"].seconds)
                for r in runs
            ]
            result["throughput_ratio_per_run"] = per_run
            print("throughput ratio per run: " + ", ".join(f"{x:.2f}x" for x in per_run))
    return result


@dataclass
class _Run:
    """One timed run of a system: the batch's seconds and generated tokens (counted from the outputs),
    single-request decode tokens/s, the outputs."""

    seconds: float
    output_tokens: int
    single: float
    outputs: list[list[int]]
    details: dict = field(default_factory=dict)  # the system's own (BenchSystem.run_details)


def _median_figures(system: str, runs: list[_Run]) -> OfflineFigures:
    secs = statistics.median(r.seconds for r in runs)
    single = statistics.median(r.single for r in runs)
    tokens = statistics.median(r.output_tokens for r in runs)
    return OfflineFigures(system, int(tokens), secs, tokens / secs, single)


# The CUDA caching allocator's counts a run's figures carry (their change over the run): memory taken from the device
# and given back, and allocations retried after freeing its cache. A run that still grows the cache, or frees it
# under pressure, shows here (a first timed run 2-4x its later ones on an H200 is not explained yet).
ALLOCATOR_COUNTS = {
    "num_device_alloc": "device_mallocs",
    "num_device_free": "device_frees",
    "num_alloc_retries": "alloc_retries",
}


def _allocator_counts() -> dict[str, int]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(key, 0)) for key, name in ALLOCATOR_COUNTS.items()}


_OLDEST_GENERATION = 2  # (CPython's collector has three; a collection of the oldest walks everything not frozen)


class CollectorTime:
    """The garbage collector's work while the block runs (``gc.callbacks``): its full collections and the seconds of
    all its collections. A full collection walks every object the process tracks and not frozen: on the host proxy,
    one set off by ``LLM.generate``'s intake, before its heap was frozen, took 0.18 s of a 0.9 s run (a candidate for
    the H200's slow first timed runs: such time is in no engine step, so ``slowest_step`` would not show it). (Python
    3.14's incremental collector reports its old generation's work in increments: there the seconds tell more than
    the count.)"""

    def __init__(self) -> None:
        self.full_collections = 0
        self.seconds = 0.0
        self._start = 0.0

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._start
        self.full_collections += info["generation"] == _OLDEST_GENERATION

    def __enter__(self) -> CollectorTime:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def figures(self) -> dict[str, float | int]:
        return {"gc_full_collections": self.full_collections, "gc_s": self.seconds}


class BenchSystem(ABC):
    """A system under test: greedy generation over token-id prompts."""

    name: str

    def measure(self, prompts: list[list[int]], output_len: int) -> _Run:
        """Greedy generation of ``output_len`` tokens for every prompt, timed, and of one prompt
        alone (single-request decode: the time of ``output_len`` tokens less the time of one)."""
        before = _allocator_counts()
        with CollectorTime() as collector:
            total, outputs = _timed(lambda: self.generate(prompts, output_len))
        details = self.run_details() | collector.figures()
        after = _allocator_counts()
        details |= {name: count - before.get(name, 0) for name, count in after.items()}
        t1, _ = _timed(lambda: self.generate(prompts[:1], 1))
        tn, _ = _timed(lambda: self.generate(prompts[:1], output_len))
        return _Run(total, sum(len(o) for o in outputs), (output_len - 1) / (tn - t1), outputs, details)

    def run_details(self) -> dict:
        """What the system can tell of its last ``generate`` beyond its time (into each run's figures)."""
        return {}

    @abstractmethod
    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]: ...


class BoundlessSystem(BenchSystem):
    name = "boundless"

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._step_seconds: list[float] = []  # each engine step's of the last generate

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        # Every timed run starts cold: no prefix cache left from the last one.
        core = self.llm.engine
        core.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        times = self._step_seconds = []
        step = core.step

        def timed_step() -> list:
            start = time.perf_counter()
            try:
                return step()
            finally:
                times.append(time.perf_counter() - start)

        wrapped = core.__dict__.get("step")  # (a step already wrapped on the instance: put back after)
        core.step = timed_step  # type: ignore[method-assign]
        try:
            return [r.outputs[0].token_ids for r in self.llm.generate(prompts, params)]
        finally:
            if wrapped is None:
                del core.step  # the class's method again
            else:
                core.step = wrapped  # type: ignore[method-assign]

    def run_details(self) -> dict:
        """The last run's engine steps, and its slowest (a first run's one-off cost shows there, not spread over the
        steps)."""
        times = self._step_seconds
        if not times:
            return {}
        slowest = max(range(len(times)), key=times.__getitem__)
        return {"steps": len(times), "slowest_step_s": times[slowest], "slowest_step": slowest}


class HuggingFaceSystem(BenchSystem):
    name = "huggingface"

    def __init__(self, loaded: LoadedModel) -> None:
        self.model = load_hf_reference(loaded)
        self.pad = loaded.tokenizer.eos_token_ids[0] if loaded.tokenizer.eos_token_ids else 0
        self.device = loaded.device

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        return hf_generate(self.model, prompts, output_len, self.pad, self.device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=positive_int, default=32)
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--skip-hf", action="store_true", help="run only Boundless")
    parser.add_argument(
        "--repeats", type=positive_int, default=1, help="timed runs per system, taking turns; figures are the medians"
    )
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts")
