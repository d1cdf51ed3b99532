"""The calibration grid through a served engine: ``boundless simulate calibrate --served``.

``calibrate`` alone steps a bare ``EngineCore`` in a loop; a served engine steps the same batches while the
HTTP server, the ``openai`` client and (with a cluster) the dispatcher, its pollers and the other instances
share the cores with it. On this 2-core machine that made every served step 1.4-1.6x the bare engine's
(``docs/simulation.md``, Validation): the time is inside the step timer (the gaps between steps, scheduling
and ``finish_step``, are about 1% of it), so the simulator needs the served step's cost, not another term.

Here the grid's batches go through what ``simulate validate``'s real side runs (``bench programs``'s fresh
engine behind the HTTP server, or a fresh Ray cluster behind the real dispatcher, and the ``openai`` client
with token-id prompts), each cell's requests sent together, and the engines' own step records
(``EngineCore.step_times``) are collected after each cell. Requests reach the engine over HTTP a few
milliseconds apart, so a cell's first steps may batch fewer of them than the cell has; every step is kept
with the shape it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from boundless.bench.programs import ProgramResult, ProgramRunner, ServedEngine, served_engine
from boundless.config import KV_PATHS, ClusterConfig, positive_float
from boundless.engine.attention_time import AttentionSample
from boundless.engine.core import EngineStats
from boundless.engine.lending_stats import LendingStats

if TYPE_CHECKING:
    from boundless.bench.workloads import ProgramSpec
    from boundless.config import EngineConfig
    from boundless.model.loader import LoadedModel
    from boundless.sim.grid import CalibrationGrid

MODEL_NAME = "calibrate"
T = TypeVar("T")


async def _run_cell(client, prompts: list[list[int]], output_tokens: int, gap_s: float = 0.0) -> None:
    """One grid cell: its requests sent together, as a program's parallel calls are, or ``gap_s`` apart."""

    async def one(prompt: list[int], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=output_tokens, temperature=0.0, extra_body={"ignore_eos": True}
        )

    await asyncio.gather(*(one(p, i * gap_s) for i, p in enumerate(prompts)))


def run_served_grid(served: ServedEngine, grid: CalibrationGrid, vocab: int, seed: int = 0) -> list[AttentionSample]:
    """Every cell of ``grid`` through the server, ``grid.repeats`` whole passes; every step the engines ran for it.

    Prompts are random token ids, new in every request, so no prefix is cached between them, except the
    ``grid.shared_prefix`` tokens a cell's requests share (new in every cell)."""
    import openai

    rng = random.Random(seed)

    async def passes() -> list[AttentionSample]:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        served.take_steps()  # whatever ran before (a warm-up) is not the grid's
        samples: list[AttentionSample] = []
        cells = itertools.product(range(grid.repeats), grid.batch_sizes, grid.prompt_lens)
        for _, batch, prompt_len in cells:
            prefix = [rng.randrange(100, vocab) for _ in range(grid.shared_prefix)]
            prompts = [prefix + [rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]
            await _run_cell(client, prompts, grid.output_tokens, grid.arrival_gap_s)
            # A step is recorded before its deltas leave, so the cell's last step is in.
            samples += served.take_steps()
        await client.close()
        return samples

    return asyncio.run(passes())


@contextlib.contextmanager
def fresh_store(config: EngineConfig) -> Iterator[EngineConfig]:
    """``config`` with its disk store (``--kv-disk-path``, if given) in a fresh directory, removed after: each real run
    starts with an empty store, as the simulation does."""
    if not config.cache.kv_disk_path:
        yield config
        return
    os.makedirs(config.cache.kv_disk_path, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="boundless-validate-", dir=config.cache.kv_disk_path) as path:
        yield dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_disk_path=path))


def add_roles_arguments(parser: argparse.ArgumentParser, roles_help: str) -> None:
    """``--roles`` (``roles_help`` says what it does in the command) and the prefill and decode cluster's read path
    and emulated links, as ``simulate validate`` and ``simulate calibrate --served`` take them alike."""
    parser.add_argument("--roles", default="", help=roles_help)
    parser.add_argument(
        "--kv-path", default="dualpath", choices=KV_PATHS, help="with --roles: basic, dualpath or oracle"
    )
    parser.add_argument("--storage-gbps", type=positive_float, help="with --roles: each engine's emulated storage NIC")
    parser.add_argument("--net-gbps", type=positive_float, help="with --roles: each engine's emulated compute NIC")


def roles_cluster_base(args: argparse.Namespace) -> ClusterConfig:
    """The cluster of :func:`add_roles_arguments`' flags (read path, links), before it is sized."""
    return ClusterConfig(kv_path=args.kv_path, storage_gbps=args.storage_gbps, net_gbps=args.net_gbps)


@dataclasses.dataclass(frozen=True)
class ServedProgramsRun:
    """One served run of programs: their results, every step the engines ran meanwhile (with its arrivals and
    departures), and each engine's stats after it (with a cluster, once the last heartbeats are in)."""

    results: list[ProgramResult]
    steps: list[AttentionSample]
    stats: list[EngineStats]

    @property
    def lending(self) -> LendingStats | None:
        """What the instances lent, summed (None without KV lending)."""
        lent = [s.lending for s in self.stats if s.lending is not None]
        return LendingStats.total(lent) if lent else None


def run_programs_on_a_fresh_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    cluster: ClusterConfig | None,
    programs: list[ProgramSpec],
    model_name: str = MODEL_NAME,
    desc: str = "calibration programs",
) -> ServedProgramsRun:
    """``programs`` as one of ``simulate validate``'s real runs serves them: a fresh engine (or cluster) with
    ``config``, nothing run on it before, behind the server, the ``openai`` client sending token-id prompts at the
    programs' arrival times; the run's results, steps and stats (validate's real side and ``calibrate --served``'s
    program runs both run this).

    Served steps of the same shapes cost a level of their own on each fresh engine (1.03-1.24x between validate's
    repeats of the same programs, ``docs/simulation.md``, Validation), and validate serves each repeat on a fresh
    one: a calibration that serves its programs on the engine that ran its grid samples one level, not theirs. Its
    disk store (if ``config`` has one) is fresh too, as validate's."""
    with fresh_store(config) as config, served_engine(loaded, config, cluster, model_name=model_name) as served:
        served.take_steps()  # whatever ran before (a warm-up) is not the run's
        runner = ProgramRunner(served.url, model_name, served.max_model_len, loaded.arch.vocab_size)
        results, steps = asyncio.run(taking_steps(runner.run(programs, desc), served.take_steps))
        if cluster is not None:
            time.sleep(2 * cluster.heartbeat_interval_s)  # let the last heartbeats in
        stats = list(served.stats().values())
    return ServedProgramsRun(results, steps, stats)


async def taking_steps(
    work: Awaitable[T], take_steps: Callable[[], list[AttentionSample]], every_s: float = 1.0
) -> tuple[T, list[AttentionSample]]:
    """``work``'s result, and every step the engines recorded while it ran, taken every ``every_s`` seconds (in a
    thread, off the event loop) so that none ages out of the engines' bounded records."""
    done = asyncio.Event()
    steps: list[AttentionSample] = []

    async def take() -> None:
        while not done.is_set():
            steps.extend(await asyncio.to_thread(take_steps))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), every_s)

    taker = asyncio.create_task(take())
    try:
        result = await work
    finally:
        done.set()
        await taker
    steps.extend(await asyncio.to_thread(take_steps))
    return result, steps
