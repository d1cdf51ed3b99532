"""A 2-instance cluster on Ray, on this machine, with a tiny random model behind a real server."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import zmq
from one_engine import one_engine_texts
from served_cluster import ray_with_env
from streams import kill_mid_stream, stream_all

from boundless import LLM, SamplingParams
from boundless.api.launch import ServerThread, start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.cluster.instance import FAIL_ADD_SEED_ENV
from boundless.config import ClusterConfig, ConfigError
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
THRESHOLD = 48  # tokens: longer calls are "long" and stay on their program's instance
POISON_SEED = 4242  # a request with this seed makes an instance's add raise (the instances' test hook)


def _cluster(model_dir: Path, kv_events_port: int | None = None) -> ClusterClient:
    # With a port, each instance publishes its KV events on it plus its index (vLLM's data-parallel rule).
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_events_port}", "topic": "kv"}
    kv_events = {"kv_events_config": events} if kv_events_port is not None else {}
    config = engine_config(str(model_dir), max_model_len=1024, kv_cache_gb=0.05, **kv_events)
    # A generous heartbeat timeout: on a loaded 2-core machine a slow heartbeat must not pass for
    # a death. A killed process is still found at once, by its failing poll. No restarts: a lost instance stays
    # lost here (tests/cluster/test_cluster_restart.py restarts one).
    cluster = ClusterConfig(
        instances=2, locality_threshold=THRESHOLD, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, max_restarts=0
    )
    return ClusterClient(config, cluster)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    with ray_with_env(FAIL_ADD_SEED_ENV, str(POISON_SEED)):
        yield


@pytest.fixture(scope="module")
def kv_subscribers() -> Iterator[list[zmq.Socket]]:
    """Two SUB sockets on 127.0.0.1, connected to consecutive ports: instance ``i`` binds the ``i``-th. (Subscribers
    that bind, before Ray starts, hear nothing: Ray's processes inherit their listening sockets.)"""
    port = _two_free_ports()
    ctx = zmq.Context()
    subs = [ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)]
    for i, sub in enumerate(subs):
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{port + i}")
    yield subs
    for sub in subs:
        sub.close(0)
    ctx.term()


def _two_free_ports() -> int:
    """A port of 127.0.0.1 free, as is the one after it, outside the ranges Ray's processes take ports from as it
    starts (its workers' 10002-19999, the kernel's ephemeral ports from 32768): the instances bind them only after
    Ray has started, and a port the kernel had given out as free was once taken meanwhile ("Address already in use")."""
    rng = random.Random()
    while True:
        port = rng.randrange(20_000, 32_000)
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


@pytest.fixture(scope="module")
def cluster(
    model_dirs: dict[str, Path], ray_session: None, kv_subscribers: list[zmq.Socket]
) -> Iterator[tuple[ClusterClient, ServerThread]]:
    port = int(kv_subscribers[0].getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    client = _cluster(model_dirs["tiny-llama"], port)
    server = start_in_thread(client, "tiny")
    yield client, server
    server.stop()
    client.shutdown()


def test_long_calls_stay_home_short_calls_spread_outputs_match(
    cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    # A program whose conversation grows: every call is long and extends the previous one.
    conversation = list(range(10, 70))
    served_long, prompts_long, hits = [], [], []
    for turn in range(5):
        r = api.completions.create(
            model="tiny",
            prompt=conversation,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "program_id": "agent", "return_token_ids": True},
        )
        served_long.append(r.system_fingerprint)
        prompts_long.append(list(conversation))
        hits.append(r.usage.prompt_tokens_details.cached_tokens)
        conversation += r.choices[0].model_extra["token_ids"] + [100 + turn] * 8
    assert len(set(served_long)) == 1, served_long  # one instance holds the program's KV
    assert all(h > 0 for h in hits[1:]), hits  # and every later call hits its prefix cache
    # A call an instance rejects leaves its program idle (so it can expire), like completed ones. Only the
    # engine checks prompt plus max_tokens against the context; its message shows the instance answered.
    with pytest.raises(openai.BadRequestError) as rejected:
        api.completions.create(model="tiny", prompt=[10], max_tokens=1024, extra_body={"program_id": "agent"})
    assert rejected.value.body["param"] == "max_tokens"
    assert "maximum context length is 1024 tokens" in rejected.value.body["message"]
    record = client.dispatcher.table.get("agent")
    assert record is not None and record.active_calls == 0 and record.completed_calls == 5
    # Short calls (no program) spread across both instances.
    short_prompts = [[200 + i, 201, 202] for i in range(8)]
    served_short = [
        api.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        for p in short_prompts
    ]
    spread = {r.system_fingerprint for r in served_short}
    assert spread == {"boundless-0", "boundless-1"}, str(httpx.get(server.url + "/cluster").json())
    # Greedy outputs equal a single engine's.
    texts = [r.choices[0].text for r in served_short]
    assert texts == one_engine_texts(tiny_llama, short_prompts, 6)
    cluster_view = httpx.get(server.url + "/cluster").json()["instances"]
    assert [i["state"] for i in cluster_view] == ["alive", "alive"]
    assert all(i["pid"] != os.getpid() for i in cluster_view)  # separate processes
    # /metrics counts from the instances' heartbeats (every 0.2 s here): the last calls' tokens come with the next one.
    wanted = [f'boundless_generation_tokens_total{{instance="{i}"}}' for i in ("0", "1")]
    deadline = time.monotonic() + 10
    metrics = httpx.get(server.url + "/metrics").text
    while not all(line in metrics for line in wanted) and time.monotonic() < deadline:
        time.sleep(0.1)
        metrics = httpx.get(server.url + "/metrics").text
    assert all(line in metrics for line in wanted), metrics


def test_each_instance_publishes_its_kv_events_on_its_own_port(
    cluster: tuple[ClusterClient, ServerThread], kv_subscribers: list[zmq.Socket]
) -> None:
    """--kv-events-config with --instances: the instance that served a prompt stores its blocks on its own port, its
    batches saying its rank."""
    _, server = cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompt = [(13 * j) % 250 + 7 for j in range(64)]  # four full blocks, of no other test
    r = api.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    rank = int(r.system_fingerprint.removeprefix("boundless-"))
    sub, found = kv_subscribers[rank], []
    while not found and sub.poll(5000):  # (earlier tests' batches come first)
        _, _, payload = sub.recv_multipart()
        _, events, batch_rank = msgpack.unpackb(payload)
        assert batch_rank == rank
        found = [e for e in events if e["type"] == "BlockStored" and e["token_ids"] == prompt]
    assert len(found) == 1 and len(found[0]["block_hashes"]) == 4 and found[0]["parent_block_hash"] is None


def test_the_instances_calls_leave_no_task_events_in_ray(cluster: tuple[ClusterClient, ServerThread]) -> None:
    # Ray's GCS keeps each actor call's task events (about 4 KB a call, up to 100,000 calls): the pollers' drains, ten
    # a second per instance while idle, and the heartbeats grew an idle 2-instance server's GCS by 80 KB a second.
    # The front end's calls to its instances are plumbing, recorded nowhere.
    import ray._private.state

    _, server = cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for i in range(4):
        api.completions.create(model="tiny", prompt=f"call {i}", max_tokens=2)
    recorded: list[str] = []
    for _ in range(6):  # (a worker reports its task events to the GCS once a second)
        time.sleep(0.5)
        events = ray._private.state.state._get_all_task_events()
        recorded = [e.task_info.name for e in events if e.task_info.name.startswith("EngineInstance")]
        if recorded:
            break
    assert recorded == []


def test_a_request_that_fails_in_add_fails_alone(cluster: tuple[ClusterClient, ServerThread]) -> None:
    client, server = cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)  # one connection throughout
    for _ in range(2):  # each attempt may land on either instance; neither may die of it
        with pytest.raises(openai.InternalServerError) as failed:
            api.completions.create(
                model="tiny", prompt=[40, 41, 42], max_tokens=2, seed=POISON_SEED, extra_body={"program_id": "poison"}
            )
        error = failed.value.body
        assert failed.value.status_code == 500 and error["type"] == "server_error" and error["code"] == "instance_error"
        # The message says what failed on the instance: the remote exception's type and message.
        assert f"RuntimeError: test hook {FAIL_ADD_SEED_ENV}: add fails for seed {POISON_SEED}" in error["message"]
    states = [i["state"] for i in httpx.get(server.url + "/cluster").json()["instances"]]
    assert states == ["alive", "alive"]
    record = client.dispatcher.table.get("poison")
    assert record is not None and record.active_calls == 0  # the failed calls keep no program active
    served = [
        api.completions.create(model="tiny", prompt=[50 + i, 51, 52], max_tokens=3, temperature=0) for i in range(6)
    ]
    assert {r.system_fingerprint for r in served} == {"boundless-0", "boundless-1"}
    assert client.dispatcher.num_failovers == 0


def test_more_samples_than_every_queue_holds_is_a_400(cluster: tuple[ClusterClient, ServerThread]) -> None:
    """The instances' queues hold 2 x 1,024 requests (--max-waiting each): 20 prompts x 128 samples could never wait,
    so a 400 naming n, as one engine answers; before, a 429 with Retry-After at every try."""
    client, server = cluster
    assert client.max_waiting == 2048
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model="tiny", prompt=["hi"] * 20, n=128, max_tokens=1)
    assert err.value.body["param"] == "n"  # type: ignore[index]


def test_prompt_logprobs_come_back_through_the_cluster(
    cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    """An instance's first delta carries the prompt logprobs (as the sampled tokens' travel): echoed with ``logprobs``
    and as vLLM's ``prompt_logprobs``, those one engine computes."""
    _, server = cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompt = [60 + (7 * i) % 200 for i in range(40)]
    r = api.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 2},
    )
    llm = LLM.from_config(engine_config(tiny_llama.name, max_model_len=1024, kv_cache_gb=0.05), tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    expected = llm.generate([prompt], params)[0].prompt_logprobs
    assert expected is not None
    served = r.choices[0].model_extra["prompt_logprobs"]
    assert len(served) == len(prompt) and served[0] is None
    offline = [position[token].logprob for token, position in zip(prompt[1:], expected[1:], strict=True)]  # type: ignore[index]
    for token, entry, logprob in zip(prompt[1:], served[1:], offline, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
    echoed = r.choices[0].logprobs.token_logprobs
    assert echoed[0] is None and echoed[1 : len(prompt)] == pytest.approx(offline, abs=1e-4)


def test_embeddings_come_back_through_the_cluster(
    cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    """``/v1/embeddings`` on two instances: each input's embedding is what one engine computes."""
    _, server = cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompts = [[60 + (7 * i) % 200 for i in range(n)] for n in (5, 30, 70)]
    reply = api.embeddings.create(model="tiny", input=prompts)
    llm = LLM.from_config(engine_config(tiny_llama.name, max_model_len=1024, kv_cache_gb=0.05), tiny_llama)
    for item, expected in zip(reply.data, llm.embed(prompts), strict=True):
        assert item.embedding == pytest.approx(expected.outputs.embedding, abs=1e-5)


def test_killing_an_instance_mid_stream_loses_nothing(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel, ray_session: None
) -> None:
    client = _cluster(model_dirs["tiny-llama"])
    server = start_in_thread(client, "tiny")
    prompts = [[30 + i, 31, 32, 33, 34] for i in range(16)]
    max_tokens = 300
    try:
        texts = stream_all(server.url, prompts, max_tokens, kill_mid_stream(client, "1", max_tokens))
        assert client.dispatcher.num_failovers > 0  # the dead instance had streams in flight
        assert texts == one_engine_texts(tiny_llama, prompts, max_tokens)
        deadline = time.monotonic() + 10
        while client.dispatcher.views["1"].alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.dispatcher.views["1"].alive
        states = {i["id"]: i["state"] for i in httpx.get(server.url + "/cluster").json()["instances"]}
        assert states == {"0": "alive", "1": "dead"}
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        later = [api.completions.create(model="tiny", prompt=p, max_tokens=3) for p in prompts[:6]]
        assert {r.system_fingerprint for r in later} == {"boundless-0"}
    finally:
        server.stop()
        client.shutdown()


def test_an_instances_warnings_reach_the_servers_output(
    cluster: tuple[ClusterClient, ServerThread], capfd: pytest.CaptureFixture[str]
) -> None:
    # The engines' own reports of their faults (a store file failing its checks, writes off on a full disk, a step
    # that failed) are log lines in their processes; Ray kept them in its session's files, so an operator of a
    # cluster saw none of them where a single engine's server prints them.
    import ray

    def warn_in_instance(instance: object, message: str) -> None:  # in the instance's process (pickled by value)
        import logging

        logging.getLogger("boundless.kv.disk_store").warning(message)

    client, _ = cluster
    message = f"store fault seen by the operator {os.getpid()}"
    ray.get(client.instances["0"].actor.__ray_call__.remote(warn_in_instance, message), timeout=30)
    seen = ""
    deadline = time.monotonic() + 20  # Ray's log monitor forwards a worker's lines within about a second
    while message not in seen and time.monotonic() < deadline:
        time.sleep(0.2)
        out, err = capfd.readouterr()
        seen += out + err
    assert message in seen


def test_a_config_an_instance_refuses_is_one_clear_error(
    cluster: tuple[ClusterClient, ServerThread], model_dirs: dict[str, Path]
) -> None:
    # Checked where the model is loaded, in each actor: the server stopped with Ray's error, the actor's whole
    # traceback, where a single engine's server gives the one line (`boundless: --max-model-len: ...`).
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, num_kv_blocks=8)
    with pytest.raises(ConfigError) as refused:
        ClusterClient(config, ClusterConfig(instances=2, max_restarts=0))
    assert str(refused.value).startswith("--max-model-len: 1024 tokens do not fit in the KV pool (128 tokens)")
    assert "Traceback" not in str(refused.value)


def test_instances_on_gpus_a_started_cluster_lacks_are_refused_not_awaited(
    cluster: tuple[ClusterClient, ServerThread], model_dirs: dict[str, Path]
) -> None:
    # Before, Ray waited for ever for GPUs no node had, repeating "No available node types can fulfill resource
    # request {'GPU': 1.0}", and the server never started nor stopped.
    config = engine_config(str(model_dirs["tiny-llama"]), device="cuda")
    with pytest.raises(
        ConfigError, match=r"--device cuda: 2 engine instances need 2 GPUs, one each; the Ray cluster has 0"
    ):
        ClusterClient(config, ClusterConfig(instances=2))
    split = engine_config(str(model_dirs["tiny-llama"]), device="cuda", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"2 engine instances need 4 GPUs, 2 each \(--tensor-parallel-size\)"):
        ClusterClient(split, ClusterConfig(instances=2))
