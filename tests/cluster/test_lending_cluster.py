"""KV lending across a 2-instance Ray cluster behind a real server: a long request whose instance runs out of
blocks while calls of its program wait there gets blocks moved to the other instance; output unchanged. And the
same with the creditor killed while it holds them (the debtor recomputes; the creditor, restarted, lends again),
and with the debtor killed (the creditor frees its blocks; the calls fail over): output unchanged. Two requests
over one pool start on the gManager's grants, one at a time; with the creditor lost for good, one is a 503."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from lending_cases import GPU_LIKE
from streams import wait_for_state

from boundless import LLM, SamplingParams
from boundless.api.launch import ServerThread, start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.config import ClusterConfig, EngineConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
BLOCKS = 96  # per instance, 16 tokens each
LONG = [(13 * j) % 300 + 3 for j in range(960)]  # 60 blocks; with its output 90 of the 96
WAITERS = [[(7 * j + 31 * i) % 300 + 5 for j in range(640)] for i in range(2)]  # 40 blocks each: they wait
# The long call decodes for hundreds of steps: time for several heartbeats and plans on a loaded machine.
LONG_TOKENS, WAITER_TOKENS = 480, 16
MAX_LEN = BLOCKS * 16


def _lending_server(config: EngineConfig, cluster: ClusterConfig) -> Iterator[tuple[ClusterClient, ServerThread]]:
    """A Ray cluster lending KV behind a server, torn down after. The gManager plans with a fixed GPU-like cost model
    (a step's fixed cost dominates): the tiny model's steps are so short that, timed on a loaded machine, a fit of
    them leaves the planner's gain to noise. Its fit of the real step times (which the heartbeats carry) is checked
    at the end: the instances' step times reached it and determine a model."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    client = ClusterClient(config, cluster)
    assert client.lending is not None
    fit = client.lending.gm.model
    client.lending.gm.model = lambda: GPU_LIKE  # type: ignore[method-assign]
    server = start_in_thread(client, "tiny")
    yield client, server
    assert fit() is not None
    server.stop()
    client.shutdown()
    ray.shutdown()


LENDING_FLAGS = dict(
    heartbeat_interval_s=0.1,
    heartbeat_timeout_s=30.0,
    kv_lending="on",
    lending_interval_s=0.2,
    lending_min_gain=0.0,
    lending_reservation_timeout_s=10.0,
    kv_handoff_timeout_s=10.0,  # a round trip to a killed creditor fails within this
)


@pytest.fixture
def lending_cluster(model_dirs: dict[str, Path]) -> Iterator[tuple[ClusterClient, ServerThread]]:
    # fcfs: the long call, first in, is never the one preempted when its instance runs short again
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=MAX_LEN, num_kv_blocks=BLOCKS, policy="fcfs")
    # The program's calls all go to its instance.
    cluster = ClusterConfig(instances=2, locality_threshold=48, restart_delay_s=1.0, **LENDING_FLAGS)
    yield from _lending_server(config, cluster)


def _offline(loaded: LoadedModel, prompts: list[list[int]], max_tokens: list[int], kv: str = "auto") -> list[str]:
    config = engine_config(loaded.name, max_model_len=MAX_LEN, num_kv_blocks=4 * BLOCKS, kv_cache_dtype=kv)
    llm = LLM.from_config(config, loaded)
    out = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        out.append(llm.generate([prompt], params)[0].outputs[0].text)
    return out


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Watch:
    """Polls ``/cluster`` while the requests run: the most blocks each instance lent and borrowed at once, and the
    most requests it held back (the deadlock breaker's). With ``kill`` ("lent" or "borrowed"), kills (SIGKILL) the
    first instance seen with blocks so, mid-decode of the long request."""

    def __init__(self, url: str, kill: str | None = None) -> None:
        self.url = url
        self.kill = kill
        self.seen: dict[str, dict[str, int]] = {}
        self.killed: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client() as http:
            while not self._done.wait(0.05):
                for inst in http.get(self.url + "/cluster").json()["instances"]:
                    best = self.seen.setdefault(inst["id"], {"lent": 0, "borrowed": 0, "held": 0})
                    best["lent"] = max(best["lent"], inst["kv_blocks_lent"])
                    best["borrowed"] = max(best["borrowed"], inst["kv_blocks_borrowed"])
                    best["held"] = max(best["held"], len(inst["requests_held"]))
                    best["waiting_for_room"] = max(best.get("waiting_for_room", 0), inst["requests_waiting_for_room"])
                    best["awaiting_grant"] = max(best.get("awaiting_grant", 0), len(inst["requests_awaiting_grant"]))
                    if self.kill and self.killed is None and inst[f"kv_blocks_{self.kill}"] > 0:
                        os.kill(inst["pid"], signal.SIGKILL)
                        self.killed = inst["id"]


async def _workload(url: str) -> list[str]:
    """Warm-up calls on both instances, then the long call and, once it runs, its program's waiting calls."""
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    # Batches of several sizes on both instances, for the gManager's step-time fit.
    for size in (1, 2, 4):
        await asyncio.gather(
            *(
                api.completions.create(model="tiny", prompt=[200 + i, 201, 202], max_tokens=8, temperature=0)
                for i in range(size)
            )
        )
    started = asyncio.Event()

    async def one(prompt: list[int], max_tokens: int, first: asyncio.Event | None = None) -> str:
        stream = await api.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "program_id": "long"},
        )
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if first is not None:
                first.set()
        return "".join(parts)

    long = asyncio.create_task(one(LONG, LONG_TOKENS, started))
    await started.wait()  # the long call runs: the waiting calls find its instance's blocks taken
    waiters = await asyncio.gather(*(one(p, WAITER_TOKENS) for p in WAITERS))
    texts = [await long, *waiters]
    await api.close()
    return texts


def _lent_run(url: str, loaded: LoadedModel) -> tuple[str, str, str]:
    """The workload through the server at ``url``, its answers one engine's; the debtor and the creditor, as
    ``/cluster`` showed them while it ran (the long call's blocks borrowed on one, lent on the other); ``/metrics``
    after."""
    with Watch(url) as watch:
        texts = asyncio.run(_workload(url))
    assert texts == _offline(loaded, [LONG, *WAITERS], [LONG_TOKENS] + [WAITER_TOKENS] * 2)
    seen = watch.seen
    debtor = max(seen, key=lambda iid: seen[iid]["borrowed"])
    creditor = next(iid for iid in seen if iid != debtor)
    assert seen[debtor]["borrowed"] > 0 and seen[creditor]["lent"] > 0, seen
    return debtor, creditor, httpx.get(url + "/metrics").text


def test_a_long_request_lends_blocks_to_the_other_instance_output_unchanged(
    lending_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = lending_cluster
    debtor, creditor, metrics = _lent_run(server.url, tiny_llama)
    assert _metric(metrics, "boundless_kv_lending_moves_total", direction="out", instance=debtor) > 0, re.findall(
        r"boundless_kv_lending\S+ \S+", metrics
    )
    assert _metric(metrics, "boundless_kv_lending_moves_total", direction="in", instance=creditor) > 0
    assert _metric(metrics, "boundless_kv_lending_bytes_moved_total", direction="out", instance=debtor) > 0
    assert client.lending.gm.counters.moves_ordered > 0


def test_a_creditor_killed_mid_decode_its_debtor_recomputes_output_unchanged(
    lending_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = lending_cluster
    with Watch(server.url, kill="lent") as watch:
        texts = asyncio.run(_workload(server.url))
    assert watch.killed is not None, watch.seen
    assert texts == _offline(tiny_llama, [LONG, *WAITERS], [LONG_TOKENS] + [WAITER_TOKENS] * 2)
    debtor = next(iid for iid in client.instances if iid != watch.killed)
    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "boundless_kv_lending_recomputed_requests_total", instance=debtor) >= 1
    # The creditor comes back (a fresh actor at its transport address) and its peer's agent lends to it again.
    restarted = wait_for_state(server.url, watch.killed, "alive")
    assert restarted["restarts"] == 1, restarted
    with Watch(server.url) as again:
        texts = asyncio.run(_workload(server.url))
    assert texts == _offline(tiny_llama, [LONG, *WAITERS], [LONG_TOKENS] + [WAITER_TOKENS] * 2)
    assert again.seen[watch.killed]["lent"] > 0 and again.seen[debtor]["borrowed"] > 0, again.seen


def test_a_debtor_killed_mid_decode_its_creditor_frees_its_blocks(
    lending_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = lending_cluster
    with Watch(server.url, kill="borrowed") as watch:
        # Its calls fail over to the creditor, where the long one fits only once the lent blocks are freed.
        texts = asyncio.run(_workload(server.url))
    assert watch.killed is not None, watch.seen
    assert texts == _offline(tiny_llama, [LONG, *WAITERS], [LONG_TOKENS] + [WAITER_TOKENS] * 2)
    assert client.dispatcher.num_failovers > 0
    creditor = next(iid for iid in client.instances if iid != watch.killed)
    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "boundless_kv_blocks_lent", instance=creditor) == 0
    assert _metric(metrics, "boundless_kv_lending_moves_total", direction="in", instance=creditor) > 0


# Two requests over one pool at once, one on each instance: started together, each would fill its pool and wait for
# room only the other could lend (the deadlock breaker then held one back). The gManager grants them one at a time
# (cluster/lending_grants.py). With --lending-request-pools the server admits contexts up to what the other instance
# lends (1.6 pools: `request_pools`).
SMALL_POOL = 16  # blocks: 256 tokens
OVER_ONE_POOL = [[(13 * j + 7 * i) % 300 + 3 for j in range(300)] for i in range(2)]  # 19 blocks; 22 with output
OVER_TOKENS = 40


# With an fp8 KV cache too: the lent blocks travel between the actors as their bytes, the creditor's partials score
# over them, and the outputs are one fp8 engine's.
@pytest.fixture(params=["auto", "fp8"])
def small_pools_cluster(
    model_dirs: dict[str, Path], request: pytest.FixtureRequest
) -> Iterator[tuple[ClusterClient, ServerThread]]:
    kv = request.param
    config = engine_config(str(model_dirs["tiny-llama"]), num_kv_blocks=SMALL_POOL, policy="fcfs", kv_cache_dtype=kv)
    # Round robin: one request on each instance. Contexts up to what the other instance lends (2 pools asked, 1.6
    # allowed by the creditor usage threshold).
    cluster = ClusterConfig(instances=2, routing="round-robin", lending_request_pools=2.0, **LENDING_FLAGS)
    yield from _lending_server(config, cluster)


def test_two_requests_over_one_pool_at_once_start_one_at_a_time_on_the_gmanager_s_grants(
    small_pools_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = small_pools_cluster
    assert client.max_model_len == int(SMALL_POOL * 1.6) * 16  # its pool and 60% of the other's

    async def both() -> list[str]:
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        calls = [
            api.completions.create(
                model="tiny", prompt=p, max_tokens=OVER_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            for p in OVER_ONE_POOL
        ]
        texts = [c.choices[0].text for c in await asyncio.wait_for(asyncio.gather(*calls), timeout=240)]
        await api.close()
        return texts

    with Watch(server.url) as watch:
        texts = asyncio.run(both())
    assert texts == _offline(tiny_llama, OVER_ONE_POOL, [OVER_TOKENS] * 2, client.engine_config.cache.kv_cache_dtype)
    # /cluster showed one awaiting its grant, and the one granted waiting for room until a move; none held back.
    assert max(seen["awaiting_grant"] for seen in watch.seen.values()) == 1, watch.seen
    assert max(seen.get("waiting_for_room", 0) for seen in watch.seen.values()) == 1, watch.seen
    assert max(seen["held"] for seen in watch.seen.values()) == 0, watch.seen
    # The gManager granted one, lent it the other's blocks, then granted the other once the first was done.
    assert client.lending.gm.counters.grants_ordered == 2 and client.lending.gm.counters.holds_ordered == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "boundless_kv_lending_granted_requests_total") == 2
    assert _metric(metrics, "boundless_kv_lending_held_requests_total") == 0
    assert "boundless_kv_lending_requests_waiting_for_room{" in metrics  # (none now: both are done)
    assert _metric(metrics, "boundless_kv_lending_moves_total", direction="out") >= 2  # each borrowed in its turn


@pytest.fixture
def no_restart_cluster(model_dirs: dict[str, Path]) -> Iterator[tuple[ClusterClient, ServerThread]]:
    config = engine_config(str(model_dirs["tiny-llama"]), num_kv_blocks=SMALL_POOL, policy="fcfs")
    # A lost instance stays lost, and a request no live instance can hold is refused 2 s after it is seen so.
    cluster = ClusterConfig(
        instances=2,
        routing="round-robin",
        lending_request_pools=2.0,
        max_restarts=0,
        lending_grant_timeout_s=2.0,
        **LENDING_FLAGS,
    )
    yield from _lending_server(config, cluster)


def test_a_request_over_one_pool_with_its_creditor_lost_for_good_is_a_503_and_the_rest_is_served(
    no_restart_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = no_restart_cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    short = [40, 41, 42]
    assert api.completions.create(model="tiny", prompt=short, max_tokens=4, temperature=0).choices  # both report
    lost = next(i for i in httpx.get(server.url + "/cluster").json()["instances"] if i["id"] == "1")
    os.kill(lost["pid"], signal.SIGKILL)
    assert wait_for_state(server.url, "1", "dead")["state"] == "dead"
    # 22 blocks with its output, on the one live instance's 16 and nothing to borrow: refused, streamed or not.
    long = dict(model="tiny", prompt=OVER_ONE_POOL[0], max_tokens=OVER_TOKENS, extra_body={"ignore_eos": True})
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as refused:
            reply = api.completions.create(**long, stream=stream)  # type: ignore[call-overload]
            list(reply) if stream else reply
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "10"
        assert refused.value.body["code"] == "kv_capacity_unavailable"
    # The live instance serves on, with the tokens a single engine gives.
    text = api.completions.create(model="tiny", prompt=short, max_tokens=8, temperature=0).choices[0].text
    assert text == _offline(tiny_llama, [short], [8])[0]
    assert client.lending.gm.counters.grants_refused == 2
    # /metrics has the instance's count from its latest heartbeat (every 0.1 s).
    deadline = time.monotonic() + 10
    while _metric(httpx.get(server.url + "/metrics").text, "boundless_kv_lending_refused_requests_total") < 2:
        assert time.monotonic() < deadline, "the refusals never reached /metrics"
        time.sleep(0.1)
    assert _metric(httpx.get(server.url + "/metrics").text, "boundless_kv_lending_refused_requests_total") == 2


@pytest.fixture
def split_lending_cluster(model_dirs: dict[str, Path]) -> Iterator[tuple[ClusterClient, ServerThread]]:
    """``lending_cluster``'s, each instance's model split over two ranks."""
    path = str(model_dirs["tiny-llama"])
    config = engine_config(path, max_model_len=MAX_LEN, num_kv_blocks=BLOCKS, policy="fcfs", tensor_parallel_size=2)
    cluster = ClusterConfig(instances=2, locality_threshold=48, restart_delay_s=1.0, **LENDING_FLAGS)
    yield from _lending_server(config, cluster)


def test_instances_of_a_split_model_lend_rank_to_rank_output_unchanged(
    split_lending_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    """``--instances 2 --tensor-parallel-size 2 --kv-lending on``: each actor's two ranks move their shares of the
    long call's blocks to the other's ranks and attend over them there (``engine/split_lending.py``); the answers
    are one device's, and the bytes on ``/metrics`` are whole blocks' (both ranks' shares)."""
    _, server = split_lending_cluster
    debtor, creditor, metrics = _lent_run(server.url, tiny_llama)
    moves = _metric(metrics, "boundless_kv_lending_moves_total", direction="out", instance=debtor)
    moved = _metric(metrics, "boundless_kv_lending_bytes_moved_total", direction="out", instance=debtor)
    arch = tiny_llama.arch
    whole_block = 2 * arch.num_layers * arch.num_kv_heads * 16 * arch.head_dim * 4  # (a rank's share: half)
    assert moves > 0 and moved > 0 and moved % whole_block == 0
    assert _metric(metrics, "boundless_distattn_round_trips_total", instance=debtor) > 0
    assert _metric(metrics, "boundless_distattn_partials_served_total", instance=creditor) > 0
    assert _metric(metrics, "boundless_kv_lending_recomputed_requests_total", instance=debtor) == 0  # (attended there)
