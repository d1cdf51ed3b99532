"""Fit the KV-lending planner's step-time model to a real engine's steps, and say how well it predicts others.

Runs waves of requests of mixed lengths through one engine (so its steps span batch sizes, contexts and prefill
chunks), records every step (``EngineCore.step_times``), fits the model on every other step and reports its
relative error on the rest. Usage::

    python scripts/fit_step_times.py [--model smollm2-135m] [--device cpu] [--waves 6] [--timer wall|process]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from boundless.cluster.perf_model import fit_step_time_model
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import AttentionSample
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import load_model


def run_waves(core: EngineCore, waves: int, seed: int) -> None:
    """Waves of 1, 2, 4, ... requests with prompts of 32-1024 tokens and 16-64 new tokens each."""
    rng = random.Random(seed)
    vocab = core.identity.vocab_size
    for wave in range(waves):
        for i in range(2**wave if wave < 6 else 32):
            prompt = [rng.randrange(100, vocab) for _ in range(rng.choice((32, 128, 512, 1024)))]
            params = SamplingParams(max_tokens=rng.choice((16, 32, 64)), ignore_eos=True)
            core.add_request(f"w{wave}-{i}", prompt, params)
        while core.has_unfinished():
            core.step()


def errors(samples: list[AttentionSample], model) -> dict[str, float]:
    rel = sorted(abs(model.predict(s.shapes) - s.seconds) / s.seconds for s in samples)
    return {
        "steps": len(rel),
        "median_rel_error": statistics.median(rel),
        "p90_rel_error": rel[int(0.9 * (len(rel) - 1))],
        "within_10pct": sum(r <= 0.1 for r in rel) / len(rel),
        "within_25pct": sum(r <= 0.25 for r in rel) / len(rel),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--timer",
        choices=("wall", "process"),
        default="wall",
        help="wall: step times as the engine measures them; process: the CPU seconds the process spent on each "
        "step, which other processes on the same cores do not inflate (for a busy machine; CPU only)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        ModelConfig(model=args.model, device=args.device, max_model_len=2048),
        CacheConfig(num_kv_blocks=4096, enable_prefix_caching=False),
        SchedulerConfig(policy="fcfs", max_num_batched_tokens=512, max_num_seqs=64),
    )
    core = EngineCore.from_model(load_model(args.model, device=args.device), config)
    if args.timer == "process":
        core.executor.timer = time.process_time  # type: ignore[attr-defined]
    # A short warm-up (first-call compilation and allocation) that the fit should not see.
    run_waves(core, 1, args.seed + 1)
    core.step_times.drain()
    start = time.perf_counter()
    run_waves(core, args.waves, args.seed)
    samples = core.step_times.drain()
    fit_on, held_out = samples[::2], samples[1::2]
    model = fit_step_time_model(fit_on)
    decodes = [s for s in held_out if all(c.new == 1 for c in s.shapes)]
    result = {
        "model": args.model,
        "device": args.device,
        "timer": args.timer,
        "threads": torch.get_num_threads(),
        "run_s": time.perf_counter() - start,
        "batch_sizes": sorted({len(s.shapes) for s in samples}),
        "coefficients": {name: getattr(model, name) for name in ("base_s", "per_seq_s", "per_token_s", "per_pair_s")},
        "held_out_all": errors(held_out, model),
        "held_out_decode": errors(decodes, model) if decodes else None,
        "samples": [[[[c.cached, c.new] for c in s.shapes], s.seconds] for s in samples],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
