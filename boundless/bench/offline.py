"""``boundless bench offline``: Hugging Face ``generate`` and Boundless on the same prompts, side by side."""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass

import torch

from boundless.bench.report import print_table, write_json
from boundless.config import engine_config_from_flags
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM
from boundless.model.loader import LoadedModel, load_model


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


def load_hf_reference(loaded: LoadedModel):
    """The same weights in transformers (dequantized from the same GGUF when the model is one)."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise SystemExit("bench offline compares against transformers: pip install 'boundless-serve[test]'") from e
    transformers.logging.set_verbosity_error()
    path = loaded.path
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=loaded.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=loaded.dtype)
    return model.to(loaded.device).eval()


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


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(args: argparse.Namespace) -> dict:
    config = engine_config_from_flags(args)
    loaded = load_model(config.model.model, dtype=config.model.dtype, device=config.model.device)
    prompts = make_prompts(loaded, args.num_prompts, args.input_len, args.bench_seed)
    figures: list[OfflineFigures] = []
    outputs: dict[str, list[list[int]]] = {}

    fig, outputs["boundless"] = _measure_boundless(LLM.from_config(config, loaded), prompts, args.output_len)
    figures.append(fig)
    gc.collect()

    if not args.skip_hf:
        fig, outputs["huggingface"] = _measure_hf(loaded, prompts, args.output_len)
        figures.insert(0, fig)

    result = {
        "model": config.model.model,
        "dtype": config.model.dtype,
        "device": config.model.device,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "figures": [asdict(f) for f in figures],
    }
    rows = [
        [f.system, f"{f.output_tokens_per_s:.1f}", f"{f.seconds:.2f}", f"{f.single_decode_tokens_per_s:.1f}"]
        for f in figures
    ]
    print_table(["system", "output tok/s", "seconds", "single-request decode tok/s"], rows)
    if len(figures) == 2:
        hf_fig, ours = figures
        result["throughput_ratio"] = ours.output_tokens_per_s / hf_fig.output_tokens_per_s
        result["single_decode_ratio"] = ours.single_decode_tokens_per_s / hf_fig.single_decode_tokens_per_s
        same = sum(a == b for a, b in zip(outputs["boundless"], outputs["huggingface"], strict=True))
        result["identical_outputs"] = same
        print(
            f"ratio (boundless / huggingface): throughput {result['throughput_ratio']:.2f}x, "
            f"single-request decode {result['single_decode_ratio']:.2f}x; "
            f"greedy outputs identical for {same}/{len(prompts)} prompts"
        )
    if args.json:
        write_json(args.json, result)
    return result


def _measure_boundless(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[OfflineFigures, list]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
    llm.engine.reset_prefix_cache()
    secs, results = _timed(lambda: llm.generate(prompts, params))
    llm.engine.reset_prefix_cache()
    t1, _ = _timed(lambda: llm.generate(prompts[:1], one))
    llm.engine.reset_prefix_cache()
    tn, _ = _timed(lambda: llm.generate(prompts[:1], params))
    total = len(prompts) * output_len
    fig = OfflineFigures("boundless", total, secs, total / secs, (output_len - 1) / (tn - t1))
    return fig, [r.outputs[0].token_ids for r in results]


def _measure_hf(loaded: LoadedModel, prompts: list[list[int]], output_len: int) -> tuple[OfflineFigures, list]:
    hf = load_hf_reference(loaded)
    pad = loaded.tokenizer.eos_token_ids[0] if loaded.tokenizer.eos_token_ids else 0
    dev = loaded.device
    hf_generate(hf, prompts[:2], 4, pad, dev)  # warm up
    secs, outputs = _timed(lambda: hf_generate(hf, prompts, output_len, pad, dev))
    t1, _ = _timed(lambda: hf_generate(hf, prompts[:1], 1, pad, dev))
    tn, _ = _timed(lambda: hf_generate(hf, prompts[:1], output_len, pad, dev))
    total = len(prompts) * output_len
    return OfflineFigures("huggingface", total, secs, total / secs, (output_len - 1) / (tn - t1)), outputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true", help="run only Boundless")
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts")
