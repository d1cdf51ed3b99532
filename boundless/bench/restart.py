"""``boundless bench restart``: does the disk KV store survive a restart of the server?

One run, four server processes (``boundless serve`` started as a subprocess, each with nothing in memory):

1. **first**: a server on an empty store directory runs a multi-turn workload (agent programs of
   ``bench/workloads.py``, each call one after another, greedy); every call's prompt and output is recorded;
2. **warm**: the same server replays the recorded prompts: the hit rate a live server gets;
3. the server stops (its writer drains) and a new process starts on the same directory (``--drop-cache``
   first evicts the store's files from the page cache, as after a reboot): **restart** replays them;
4. **cold**: a new process on a fresh, empty directory replays them: what the replay costs without the store.

It prints each phase's prefix-cache hit rate (prompt tokens served from any tier), the tokens that came from
disk, whether its outputs are token-identical to the first run's, and its mean time to first token (the
servers' own histogram: arrival to first token). Goals (issue 12): restart hit rate at least 0.9 of the warm
one, identical outputs, and the restart's time to first token against the cold run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from boundless.bench.report import output_path, print_table, write_json
from boundless.bench.workloads import WORKLOADS, PromptTokens, WorkloadShape, call_prompt, make_programs
from boundless.config import (
    EngineConfig,
    add_engine_flags,
    engine_config_from_flags,
    positive_float,
    positive_int,
    to_flags,
)

MODEL_NAME = "bench"


@dataclass(frozen=True)
class RecordedCall:
    """One call of the first run: what the replays send again, and what they must answer."""

    program_id: str
    thread_id: str
    prompt: list[int]
    max_tokens: int
    output: list[int]


@dataclass
class PhaseResult:
    """One pass over the calls on one server."""

    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from any tier (usage.prompt_tokens_details.cached_tokens)
    disk_hit_tokens: int = 0  # of which loaded from the disk store
    ttft_s: float = 0.0  # mean, arrival to first token, as the server measures it
    outputs: list[list[int]] = field(default_factory=list)
    identical: bool | None = None  # outputs token-identical to the first run's

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class ServerProcess:
    """``boundless serve`` in a subprocess on 127.0.0.1, its output in ``log``."""

    def __init__(
        self,
        config: EngineConfig,
        store: Path | None,
        log: Path,
        startup_timeout_s: float = 600.0,
        extra_flags: Sequence[str] = (),
    ) -> None:
        """``store``: the disk store's directory (None: the config's); ``extra_flags``: more of ``serve``'s flags."""
        from boundless.api.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cache = config.cache if store is None else dataclasses.replace(config.cache, kv_disk_path=str(store))
        flags = to_flags(config.model) + to_flags(cache) + to_flags(config.scheduler) + list(extra_flags)
        cmd = [sys.executable, "-m", "boundless.cli", "serve", *flags, "--port", str(self.port)]
        cmd += ["--served-model-name", MODEL_NAME]
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not start in {timeout_s:.0f} s:\n{self._log_tail()}")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop as Ctrl-C does: the server drains its writes to the store before it exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@contextmanager
def running(config: EngineConfig, store: Path, log: Path, startup_timeout_s: float) -> Iterator[ServerProcess]:
    server = ServerProcess(config, store, log, startup_timeout_s)
    try:
        yield server
    finally:
        server.stop()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``/metrics`` (0 when absent)."""
    inner = ",".join(['instance="0"', *(f'{k}="{v}"' for k, v in labels.items())])
    match = re.search(re.escape(f"{name}{{{inner}}}") + r" (\S+)", text)
    return float(match.group(1)) if match else 0.0


class Client:
    """Greedy completions by token ids, one at a time."""

    def __init__(self, url: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    def complete(self, prompt: list[int], max_tokens: int, program_id: str, thread_id: str) -> tuple[list[int], int]:
        """The output token ids and the prompt tokens served from cache."""
        resp = self.client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "program_id": program_id, "thread_id": thread_id},
        )
        details = resp.usage.prompt_tokens_details if resp.usage is not None else None
        cached = (details.cached_tokens or 0) if details is not None else 0
        # (The client's models keep the fields they do not name, as model_extra: a dict, never None for them.)
        return list((resp.choices[0].model_extra or {}).get("token_ids") or []), cached

    def close(self) -> None:
        self.client.close()


class Phase:
    """Figures of one pass over the calls on one server: counted from the responses, and from ``/metrics``
    (disk hits, time to first token) as differences across the pass."""

    def __init__(self, server: ServerProcess, name: str) -> None:
        self.server = server
        self.client = Client(server.url)
        self.result = PhaseResult(name)
        self._before = server.metrics()

    def complete(self, prompt: list[int], max_tokens: int, program_id: str, thread_id: str) -> list[int]:
        out, cached = self.client.complete(prompt, max_tokens, program_id, thread_id)
        self.result.outputs.append(out)
        self.result.prompt_tokens += len(prompt)
        self.result.cached_tokens += cached
        return out

    def finish(self, expected: list[list[int]]) -> PhaseResult:
        self.client.close()  # an open keep-alive connection would hold up the server's graceful shutdown
        after = self.server.metrics()

        def delta(metric: str, **labels: str) -> float:
            return metric_sum(after, metric, **labels) - metric_sum(self._before, metric, **labels)

        r = self.result
        r.disk_hit_tokens = int(delta("boundless_kv_tier_hit_tokens_total", tier="disk"))
        count = delta("boundless_time_to_first_token_seconds_count")
        r.ttft_s = delta("boundless_time_to_first_token_seconds_sum") / count if count else float("nan")
        r.identical = r.outputs == expected
        return r


def record(
    server: ServerProcess, args: argparse.Namespace, vocab: int, max_model_len: int
) -> tuple[list[RecordedCall], PhaseResult]:
    """Run the workload's programs one call at a time; each call's prompt is its thread's conversation so far."""
    shape = WorkloadShape(scale=args.scale, call_scale=args.call_scale, tool_wait_s=0.0, max_len=args.max_len)
    programs = make_programs(args.workload, args.num_programs, 1.0, args.bench_seed, shape, args.trace_folder)
    tokens = PromptTokens(vocab, args.bench_seed)
    phase = Phase(server, "first")
    calls = []
    for spec in programs:
        rng, system = tokens.start(spec)
        contexts: dict[str, list[int]] = {}
        outputs: dict[str, list[int]] = {}
        for stage in spec.stages:
            for call in stage:
                prompt = call_prompt(call, system, contexts, outputs, tokens.draw(rng, call.new_input), max_model_len)
                out = phase.complete(prompt, call.output, spec.program_id, call.thread_id)
                contexts[call.thread_id] = prompt + out
                outputs[call.thread_id] = out
                calls.append(RecordedCall(spec.program_id, call.thread_id, prompt, call.output, out))
    return calls, phase.finish([c.output for c in calls])


def replay(server: ServerProcess, name: str, calls: list[RecordedCall]) -> PhaseResult:
    """Send the recorded prompts again, in order."""
    phase = Phase(server, name)
    for call in calls:
        phase.complete(call.prompt, call.max_tokens, call.program_id, call.thread_id)
    return phase.finish([c.output for c in calls])


def drop_page_cache(root: Path) -> None:
    """Write the store's files back and evict them from the page cache: the next reads come from the disk."""
    os.sync()
    for path in root.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(args: argparse.Namespace) -> dict:
    from boundless.engine.builder import store_directory
    from boundless.model.loader import load_configured_model

    config = engine_config_from_flags(args)
    # (A path that cannot be a directory: one line naming the flag, where mkdir's traceback came.)
    parent = store_directory(args.kv_disk_path) if args.kv_disk_path else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=parent))
    store, cold_store = work / "store", work / "cold-store"
    startup = args.startup_timeout
    # The vocabulary and the context length, for the prompts (the servers load the model themselves).
    loaded = load_configured_model(config.model, "cpu")
    vocab = loaded.arch.vocab_size
    del loaded
    try:
        print(f"store {store}; server logs in {work}", flush=True)
        with running(config, store, work / "server-first.log", startup) as server:
            max_model_len = _max_model_len(server)
            t0 = time.perf_counter()
            calls, first = record(server, args, vocab, max_model_len)
            print(f"first run: {len(calls)} calls in {time.perf_counter() - t0:.1f} s", flush=True)
            warm = replay(server, "warm", calls)
        if args.drop_cache:
            drop_page_cache(store)
        with running(config, store, work / "server-restart.log", startup) as server:
            restarted = replay(server, "restart", calls)
        with running(config, cold_store, work / "server-cold.log", startup) as server:
            cold = replay(server, "cold", calls)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return report(args, config, calls, [first, warm, restarted, cold])


def _max_model_len(server: ServerProcess) -> int:
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    return int(models[0].get("max_model_len") or 2048)


def _phase_figures(phase: PhaseResult) -> dict:
    figures = {k: v for k, v in dataclasses.asdict(phase).items() if k != "outputs"}
    return figures | {"hit_rate": phase.hit_rate}


def report(
    args: argparse.Namespace, config: EngineConfig, calls: list[RecordedCall], phases: list[PhaseResult]
) -> dict:
    first, warm, restarted, cold = phases
    rows = [
        [
            p.name,
            f"{p.hit_rate:.3f}",
            p.disk_hit_tokens,
            "yes" if p.identical else "NO",
            f"{p.ttft_s * 1000:.1f}",
        ]
        for p in phases
    ]
    print_table(["phase", "hit rate", "from disk (tokens)", "outputs identical", "mean TTFT ms"], rows)
    hit_ratio = restarted.hit_rate / warm.hit_rate if warm.hit_rate else float("nan")
    ttft_ratio = cold.ttft_s / restarted.ttft_s if restarted.ttft_s else float("nan")
    print(
        f"restart hit rate / warm hit rate: {hit_ratio:.3f} (goal >= 0.9); outputs identical after the restart: "
        f"{'yes' if restarted.identical else 'NO'}; TTFT cold / after the restart: {ttft_ratio:.2f}x",
        flush=True,
    )
    result = {
        "workload": args.workload,
        "model": config.model.model,
        "num_programs": args.num_programs,
        "calls": len(calls),
        "prompt_tokens": first.prompt_tokens,
        "drop_cache": bool(args.drop_cache),
        "phases": [_phase_figures(p) for p in phases],
        "restart_vs_warm_hit_rate": hit_ratio,
        "outputs_identical_after_restart": bool(restarted.identical),
        "ttft_cold_over_restart": ttft_ratio,
    }
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="chat")
    parser.add_argument("--num-programs", type=positive_int, default=8)
    parser.add_argument("--scale", type=positive_float, default=0.1, help="multiply the workload's token lengths")
    parser.add_argument("--call-scale", type=positive_float, default=1.0, help="multiply the calls per program")
    parser.add_argument(
        "--max-len", type=positive_int, default=512, help="cap on one call's new input and output tokens"
    )
    parser.add_argument("--trace-folder", help="mini-SWE-agent sessions for --workload trace")
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument(
        "--drop-cache", action="store_true", help="evict the store's files from the page cache before the restart"
    )
    parser.add_argument("--keep", action="store_true", help="keep the store directories and server logs")
    parser.add_argument(
        "--startup-timeout", type=positive_float, default=600.0, help="seconds a server may take to start"
    )
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
    add_engine_flags(parser)
