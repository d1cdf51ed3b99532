"""``boundless serve | generate | bench``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from boundless.bench.report import output_path
from boundless.config import ClusterConfig, ConfigError, SchedulerConfig, ServerConfig, add_engine_flags, add_flags
from boundless.config_file import ConfigFileError, add_config_flag, expand_config_file
from boundless.engine.errors import InvalidRequestError


def _generate(args: argparse.Namespace) -> int:
    from boundless.config import engine_config_from_flags
    from boundless.engine.sampling_params import SamplingParams
    from boundless.llm import LLM

    config = engine_config_from_flags(args)
    try:  # (before the model loads: a bad value is a flag's error, found at once)
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.sample_seed,
        )
    except InvalidRequestError as e:
        raise _flag_error(e) from e
    llm = LLM.from_config(config)
    try:
        if args.chat:
            results = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            results = llm.generate(args.prompt, params)
    except InvalidRequestError as e:  # the prompt (one that fills the context: longer outputs stop where it is full)
        raise _flag_error(e) from e
    finally:
        llm.close()
    print(results[0].outputs[0].text)
    return 0


def _flag_error(error: InvalidRequestError) -> ConfigError:
    """``generate``'s refused value as the error of the flag that gave it (``seed``: ``--sample-seed``, not the engine's
    ``--seed``); the prompt, an argument, is named by the message alone."""
    if error.param is None or error.param == "prompt":
        return ConfigError(str(error))
    flag = {"seed": "sample-seed"}.get(error.param, error.param.replace("_", "-"))
    return ConfigError(f"--{flag}: {error}")


def _serve(args: argparse.Namespace) -> int:
    from boundless.api.launch import serve
    from boundless.config import ClusterConfig, ServerConfig, engine_config_from_flags, from_flags

    if args.model_tag is not None:  # (vLLM's: it wins over --model)
        args.model = args.model_tag
    serve(engine_config_from_flags(args), from_flags(ServerConfig, args), from_flags(ClusterConfig, args))
    return 0


def _model_tag_as_flag(argv: list[str]) -> list[str]:
    """``serve``'s arguments with a model given first, as ``vllm serve MODEL`` takes it, moved to a ``--model`` at the
    end (where it wins, as vLLM's does): the flags of a ``--config`` file go before the arguments, and one of several
    values (``lora-modules``) would take a model after it for one of its own."""
    if argv[:1] and not argv[0].startswith("-"):
        return [*argv[1:], "--model", argv[0]]
    return argv


# ``boundless bench KIND`` past ``offline``: each kind's help, and whether it takes the engine's flags (the others drive
# a running server, or measure a part alone). Its module is ``boundless.bench.<kind>`` (a dash an underscore), whose
# ``add_arguments`` adds its own flags and whose ``run`` runs it (``_bench``).
BENCHES: tuple[tuple[str, str, bool], ...] = (
    ("serve", "online load (Poisson or trace replay) against a running server", False),
    ("programs", "agent programs under each scheduling policy, side by side", True),
    ("gpu", "the GPU path on random 1B and 8B shapes, against transformers (CUDA)", False),
    ("store", "the disk KV store's write and read GB/s against the raw disk's", False),
    ("transport", "latency and bandwidth of each transport between two processes, against a memory copy", False),
    ("restart", "a workload, a server restart on the same --kv-disk-path, the replay: hit rate, outputs, TTFT", False),
    ("handoff", "a prefill engine's KV handoff: layer by layer, or after the pass", False),
    ("agentic", "agent sessions over the KV store: basic, dualpath, oracle and colocated, side by side", True),
    ("longctx", "contexts larger than one instance: separate instances, whole-KV moves and KV lending", True),
    ("structured", "JSON-schema outputs against free decoding, and a stream's pause at the first grammar", True),
    ("spec", "speculative decoding (n-gram or suffix proposals) against plain decoding on agent calls", True),
    ("lora", "LoRA adapters in one batch against PEFT's mixed-adapter batches", True),
    ("kv-dtype", "a KV cache in --kv-cache-dtype against the model's own type, in the same memory", True),
    ("window", "a sliding-window model giving back the blocks past its window against keeping them, same pool", False),
    ("tensor-parallel", "a model split over --tensor-parallel-size ranks against it on one device", True),
    ("embed", "transformers' base model against Boundless embedding the same prompts", True),
    ("frontend", "the server's output tokens per second against its engine loop's alone, per route and mode", True),
)

# The benchmarks made for a model split over ranks (--tensor-parallel-size); the others refuse it.
SPLIT_MODEL_BENCHES = ("agentic", "embed", "offline", "restart", "tensor-parallel")


def _one_device(args: argparse.Namespace, command: str) -> None:
    """Refuse ``--tensor-parallel-size`` for a command not made for a split model (it was taken and ignored: the
    simulator's cost models are one device's; or it failed part-way: several engines on one loaded network)."""
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise SystemExit(
            f"--tensor-parallel-size: {command} does not take a split model; boundless serve, generate, simulate "
            f"(on a roofline --profile), bench {', bench '.join(SPLIT_MODEL_BENCHES)} do"
        )


def _simulation(
    command: str, run: Callable[[argparse.Namespace], object], split: bool = False
) -> Callable[[argparse.Namespace], int]:
    """A ``boundless simulate`` command's handler: its ``run``, for engines of one device (the cost models' own)
    unless ``split`` (``simulate`` itself prices a split model on a roofline profile: ``sim/profiles.py``)."""

    def handler(args: argparse.Namespace) -> int:
        if not split:
            _one_device(args, command)
        run(args)
        return 0

    return handler


def _bench(args: argparse.Namespace) -> int:
    """``boundless bench KIND``: ``boundless.bench.<kind>.run`` (a dash in a kind is an underscore in its module),
    imported only when its command runs (the parser knows each kind)."""
    if args.bench_kind not in SPLIT_MODEL_BENCHES:
        _one_device(args, f"bench {args.bench_kind}")
    importlib.import_module(f"boundless.bench.{args.bench_kind.replace('-', '_')}").run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="boundless", description="LLM serving for agent programs")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    srv.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model to serve, as vLLM's serve takes it: --model's values, and it wins over --model",
    )
    add_config_flag(srv)
    add_engine_flags(srv)
    add_flags(srv, ServerConfig)
    add_flags(srv, ClusterConfig)
    srv.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="complete one prompt offline")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    add_engine_flags(gen)
    gen.set_defaults(func=_generate)

    simulate = sub.add_parser("simulate", help="policies side by side on a workload, in virtual time")
    from boundless.sim import run as sim_run

    sim_run.add_arguments(simulate)
    add_flags(simulate, SchedulerConfig)
    simulate.set_defaults(func=_simulation("simulate", sim_run.run, split=True))
    sim_sub = simulate.add_subparsers(dest="simulate_action", required=False)
    calibrate = sim_sub.add_parser("calibrate", help="fit this machine's step model from the real engine")
    from boundless.sim import calibrate as sim_calibrate

    sim_calibrate.add_arguments(calibrate)
    calibrate.set_defaults(func=_simulation("simulate calibrate", sim_calibrate.run))
    validate = sim_sub.add_parser("validate", help="the real engine against the simulator, per workload and size")
    from boundless.sim import validate as sim_validate

    sim_validate.add_arguments(validate)
    validate.set_defaults(func=_simulation("simulate validate", sim_validate.run))

    bench = sub.add_parser("bench", help="benchmarks: baseline and Boundless side by side")
    bench_sub = bench.add_subparsers(dest="bench_kind", required=True)
    off = bench_sub.add_parser("offline", help="Hugging Face generate against Boundless, same prompts")
    from boundless.bench.offline import add_arguments

    add_arguments(off)
    off.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
    add_engine_flags(off)
    off.set_defaults(func=_bench)
    for kind, help_text, engine_flags in BENCHES:
        kind_parser = bench_sub.add_parser(kind, help=help_text)
        importlib.import_module(f"boundless.bench.{kind.replace('-', '_')}").add_arguments(kind_parser)
        if engine_flags:
            add_engine_flags(kind_parser)
        kind_parser.set_defaults(func=_bench)
    return parser


# The commands that take --config (vLLM's serve does).
CONFIG_FILE_COMMANDS = ("serve",)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = ["serve", *_model_tag_as_flag(argv[1:])]
    try:
        if argv[:1] and argv[0] in CONFIG_FILE_COMMANDS:
            argv = [argv[0], *expand_config_file(_subcommand(parser, argv[0]), argv[1:])]
    except ConfigFileError as e:
        print(f"boundless: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"boundless: {e}", file=sys.stderr)
        return 2


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of ``boundless NAME``."""
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


if __name__ == "__main__":
    sys.exit(main())
