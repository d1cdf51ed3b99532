"""``boundless bench lora``: many LoRA adapters served in one batch, against PEFT's mixed-adapter batches.

Random adapters (PEFT's layout, ``--rank``, on the projections ``--targets`` names: all seven by default) are
written for the model; ``--num-prompts`` random prompts are spread over them round-robin. Three runs take turns on
the same prompts, greedy, every output exactly ``--output-len`` tokens:

- **peft**: transformers' model with every adapter loaded in PEFT, one left-padded ``generate`` over all prompts
  with ``adapter_names`` giving each row its adapter (PEFT's mixed-adapter batch inference);
- **boundless-lora**: the engine with the adapters loaded (``max_loras`` = the number of adapters), each request
  naming its adapter;
- **boundless-base**: the engine on the same prompts without adapters, which prices the adapters' own cost.

It prints output tokens per second of each, Boundless-with-adapters over PEFT, the adapters' cost (with over without,
in the engine), and how many outputs equal PEFT's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from boundless.bench.offline import hf_generate, load_hf_reference, make_prompts
from boundless.bench.report import output_path, print_table, write_json
from boundless.config import engine_config_from_flags, positive_int, refuse_engine_flags
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM
from boundless.model.loader import LoadedModel, load_configured_model
from boundless.model.random_model import LORA_TARGETS, write_random_lora

# The engine flags this benchmark sets itself, from its own: given, they would be ignored.
SET_BY_LORA = {
    "max_loras": "use --num-adapters",
    "max_lora_rank": "from --rank",
    "lora_modules": "its --num-adapters random adapters",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters the prompts are spread over")
    parser.add_argument("--rank", type=positive_int, default=16, help="each adapter's rank")
    parser.add_argument(
        "--targets",
        default=",".join(LORA_TARGETS),
        help="the projections the adapters change, comma-separated (PEFT's default on a Llama: q_proj,v_proj)",
    )
    parser.add_argument("--num-prompts", type=positive_int, default=16)
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each system, taking turns (medians)")
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--json", type=output_path, help="write the figures here")


def _peft_model(loaded: LoadedModel, paths: list[Path]):
    try:
        from peft import PeftModel
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise SystemExit("bench lora compares against PEFT: pip install 'boundless-serve[test]'") from e
    model = PeftModel.from_pretrained(load_hf_reference(loaded), str(paths[0]), adapter_name="a0")
    for i, path in enumerate(paths[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    return model.eval()


def _peft_generate(model, prompts: list[list[int]], names: list[str], output_len: int, pad_id: int, device):
    """PEFT's mixed-adapter batch: ``hf_generate``'s padded batch (it calls only ``generate``), each row with its
    adapter (``adapter_names``)."""
    adapted = SimpleNamespace(generate=functools.partial(model.generate, adapter_names=names))
    return hf_generate(adapted, prompts, output_len, pad_id, device)


def run(args: argparse.Namespace) -> dict:
    refuse_engine_flags(args, "bench lora", SET_BY_LORA)
    config = engine_config_from_flags(args)
    if args.num_adapters < 1 or args.repeats < 1:
        raise SystemExit("--num-adapters and --repeats must be at least 1")
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if not targets or unknown:
        raise SystemExit(f"--targets: {unknown or 'none'} not among {', '.join(LORA_TARGETS)}")
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(
            config.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=max(16, args.rank)
        ),
    )
    loaded = load_configured_model(config.model)
    prompts = make_prompts(loaded, args.num_prompts, args.input_len, args.bench_seed)
    with tempfile.TemporaryDirectory(prefix="boundless-lora-") as tmp:
        paths = [
            write_random_lora(
                Path(tmp) / f"a{i}", loaded.arch, rank=args.rank, alpha=2.0 * args.rank, targets=targets, seed=i
            )
            for i in range(args.num_adapters)
        ]
        modules = tuple(f"a{i}={path}" for i, path in enumerate(paths))
        llm = LLM.from_config(
            dataclasses.replace(config, model=dataclasses.replace(config.model, lora_modules=modules)), loaded
        )
        names = [f"a{i % args.num_adapters}" for i in range(len(prompts))]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        adapted = [dataclasses.replace(params, lora_name=name) for name in names]
        peft = _peft_model(loaded, paths)
        pad_id = loaded.tokenizer.eos_token_ids[0] if loaded.tokenizer.eos_token_ids else 0  # (as bench offline)

        def boundless(per_prompt) -> list[list[int]]:
            llm.engine.reset_prefix_cache()  # every run computes its prompts
            return [r.outputs[0].token_ids for r in llm.generate(prompts, per_prompt)]

        systems = {
            "peft": lambda: _peft_generate(peft, prompts, names, args.output_len, pad_id, loaded.device),
            "boundless-lora": lambda: boundless(adapted),
            "boundless-base": lambda: boundless(params),
        }
        for fn in systems.values():  # warm up (first calls compile, allocate, fault pages in)
            fn()
        seconds: dict[str, list[float]] = {name: [] for name in systems}
        outputs: dict[str, list[list[int]]] = {}
        order = list(systems)
        for turn in range(args.repeats):
            for name in order[turn % len(order) :] + order[: turn % len(order)]:
                start = time.perf_counter()
                outputs[name] = systems[name]()
                seconds[name].append(time.perf_counter() - start)
    tokens = len(prompts) * args.output_len
    median = {name: statistics.median(s) for name, s in seconds.items()}
    rows = [[name, f"{tokens / median[name]:.1f}", f"{median[name]:.2f}"] for name in systems]
    print(
        f"{args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} out, over {args.num_adapters} "
        f"adapters of rank {args.rank} on {', '.join(targets)}; medians of {args.repeats} runs"
    )
    print_table(["system", "output tok/s", "seconds"], rows)
    same = sum(a == b for a, b in zip(outputs["boundless-lora"], outputs["peft"], strict=True))
    result = {
        "model": config.model.model,
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "targets": list(targets),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "tokens_per_s": {name: tokens / median[name] for name in systems},
        "lora_vs_peft": median["peft"] / median["boundless-lora"],
        "lora_cost": median["boundless-lora"] / median["boundless-base"],
        "identical_to_peft": same,
    }
    print(
        f"boundless-lora / peft: {result['lora_vs_peft']:.2f}x; the adapters' cost in boundless: "
        f"{result['lora_cost']:.2f}x the base model's time; outputs equal to PEFT's: {same}/{len(prompts)}"
    )
    if args.json:
        write_json(args.json, result)
    return result
