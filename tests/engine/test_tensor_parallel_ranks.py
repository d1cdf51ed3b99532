"""An engine whose model is split over two tensor-parallel ranks (``--tensor-parallel-size 2``; rank 1 a process of
its own, ``engine/tensor_parallel.py``): greedy answers are transformers', with the prefix cache, chunked prefill and
preemption that swaps every rank's blocks to host memory; a server serves it through the ``openai`` client; a rank
that dies stops the engine with an error that says so; what it cannot do with is refused at start-up."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from boundless.api.launch import local_engine, start_in_thread
from boundless.config import (
    CacheConfig,
    ClusterConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    check_serve_configs,
)
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.tensor_parallel import RankLost, TensorParallelRanks, load_with_ranks
from boundless.llm import LLM
from boundless.model.loader import LoadedModel, load_configured_model

MAX_NEW = 10
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest and",
    "Agents call language models many times in a loop, with tools between the calls. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers like 12, 345 and 6789",
]


def _transformers_greedy(loaded: LoadedModel, model: Any, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
            )  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    return out


def _config(path: Path, **cache_and_sched: Any) -> EngineConfig:
    cache = {k: v for k, v in cache_and_sched.items() if k in ("num_kv_blocks", "swap_space_gb", "kv_cache_gb")}
    sched = {
        k: v for k, v in cache_and_sched.items() if k in ("max_num_batched_tokens", "speculative_config", "policy")
    }
    return EngineConfig(
        ModelConfig(model=str(path), max_model_len=cache_and_sched.get("max_model_len", 256), tensor_parallel_size=2),
        CacheConfig(**{"kv_cache_gb": 0.01, **cache}),
        SchedulerConfig(**sched),
    )


def _greedy(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id].extend(delta.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def _ranks(core: EngineCore) -> TensorParallelRanks:
    ranks = core.executor.runner.ranks  # type: ignore[attr-defined]
    assert ranks is not None
    return ranks


# (Each 6 s of processes starting on this machine: one model in the fast suite, the others in the slow one.)
@pytest.mark.parametrize(
    "name",
    ["tiny-llama", *(pytest.param(n, marks=pytest.mark.slow) for n in ("tiny-qwen2", "tiny-phi3", "tiny-gpt-oss"))],
)
def test_two_ranks_answer_as_transformers(
    name: str, model_dirs: dict[str, Path], load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """GQA with llama3 RoPE scaling (one key/value head a rank), q/k/v biases, a fused checkpoint, gpt-oss (its sinks
    and its experts split by their features, the router whole on each rank): the prompts at once
    with the prefix cache (shared prefixes), then again in chunks of 7 tokens a step with n-gram drafts checked (a
    step's rows past the known tokens, on every rank)."""
    loaded = load(name)
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    expected = _transformers_greedy(loaded, hf_model(name), prompts)
    config = _config(model_dirs[name])
    core = EngineCore.from_model(load_configured_model(config.model), config)
    try:
        assert core.executor.runner.model.arch.num_heads == loaded.arch.num_heads // 2  # type: ignore[attr-defined]
        assert _greedy(core, prompts) == expected
        assert core.scheduler.stats.num_prompt_tokens_cached > 0
    finally:
        core.close()
    # (First come, first served: the default policy orders by service measured in seconds, and in some orders a loaded
    # machine gave no step room for drafts beside the chunks.)
    chunked = _config(model_dirs[name], max_num_batched_tokens=7, speculative_config=NGRAM, policy="fcfs")
    core = EngineCore.from_model(load_configured_model(chunked.model), chunked)
    try:
        assert _greedy(core, prompts) == expected
        assert core.counters.draft_tokens > 0
    finally:
        core.close()


def test_preemption_swaps_every_ranks_blocks_to_host_memory_and_back(
    model_dirs: dict[str, Path], load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """A pool that holds the longest request but not all at once: requests are swapped out to host memory and back
    (rank 1 makes each copy as rank 0 does), and every answer is still transformers'."""
    loaded = load("tiny-llama")
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    expected = _transformers_greedy(loaded, hf_model("tiny-llama"), prompts)
    blocks = -(-(max(len(p) for p in prompts) + MAX_NEW) // 16) + 2
    config = _config(model_dirs["tiny-llama"], num_kv_blocks=blocks, max_model_len=blocks * 16)
    core = EngineCore.from_model(load_configured_model(config.model), config)
    try:
        assert _greedy(core, prompts) == expected
        stats = core.scheduler.stats
        assert stats.num_swapped_out > 0 and stats.num_swapped_in > 0 and stats.num_recomputed == 0
    finally:
        core.close()


def _wait_health(url: str, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health").status_code != status and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").status_code == status


@pytest.mark.parametrize("max_restarts", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_server_of_two_ranks_answers_and_restarts_its_engine_when_a_rank_dies(
    max_restarts: int, model_dirs: dict[str, Path], load: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    """Through the ``openai`` client the split model answers as one engine of the whole model does. Rank 1 killed: the
    next request ends with an engine error (not a hang), the engine stops with the lost rank as its error, ``/health``
    answers unavailable and requests are refused with a 503 to retry elsewhere. Then, as ``--max-restarts`` allows,
    a fresh engine (rank 0's share kept, rank 1 launched anew, the adapter loaded at run time loaded again) answers
    again as before; without restarts it stays stopped."""
    from boundless.model.lora import LoRARequest
    from boundless.model.random_model import write_random_lora

    path = model_dirs["tiny-llama"]
    whole = LLM(str(path), max_model_len=256, kv_cache_gb=0.01)
    ask = {"model": "m", "messages": [{"role": "user", "content": "Tell me about foxes"}], "max_tokens": 12}
    cluster = ClusterConfig(restart_delay_s=1.0, max_restarts=max_restarts)
    config = _config(path)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, enable_lora=True))
    engine = local_engine(config, max_waiting=16, cluster=cluster)
    engine.add_lora(LoRARequest("ad", 1, str(write_random_lora(tmp_path / "ad", load("tiny-llama").arch))))
    server = start_in_thread(engine, "m")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        got = client.chat.completions.create(**ask, temperature=0)
        reference = whole.chat(ask["messages"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
        assert got.choices[0].message.content == reference
        ranks = _ranks(engine.core)
        ranks.processes[0].kill()
        ranks.processes[0].wait(10)
        with pytest.raises(openai.InternalServerError, match="the engine failed while generating"):
            client.chat.completions.create(**ask, temperature=0)
        _wait_health(server.url, 503, 10)
        assert "tensor parallelism: rank 1 exited (code -9)" in str(engine.error)
        with pytest.raises(openai.APIStatusError, match="engine stopped after an error") as refused:
            client.chat.completions.create(**ask, temperature=0)
        assert refused.value.status_code == 503
        with pytest.raises(RankLost):
            ranks.check()
        if max_restarts:
            _wait_health(server.url, 200, 60)
            again = client.chat.completions.create(**ask, temperature=0)
            assert again.choices[0].message.content == reference
            assert _ranks(engine.core) is not ranks and engine.error is None
            assert list(engine.core.loras) == ["ad"]
            assert engine.restarts is not None and engine.restarts.counts("0") == (1, 1, 0)  # lost once, back once
        else:
            time.sleep(1.5)  # (past the delay a restart would have waited)
            assert httpx.get(f"{server.url}/health").status_code == 503 and engine.core.executor.runner.ranks is ranks
    finally:
        server.stop()
        engine.shutdown()
        whole.close()


def test_an_engine_that_fails_after_its_ranks_joined_stops_them_and_frees_its_network(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks launched by the engine's build, which then fails on rank 0 (here: its sampler): they are stopped and rank
    0's network sums nowhere, so the next build on it (a restart in place) succeeds. (They were left running, and
    every later build was refused: "rank 0 of another tensor-parallel engine already".)"""
    from boundless.engine import builder

    config = _config(model_dirs["tiny-llama"])
    loaded = load_configured_model(config.model)
    launched: list[TensorParallelRanks] = []
    launch = TensorParallelRanks.launch
    monkeypatch.setattr(TensorParallelRanks, "launch", lambda *a: launched.append(launch(*a)) or launched[-1])
    with monkeypatch.context() as patched:
        patched.setattr(builder, "Sampler", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no sampler")))
        with pytest.raises(RuntimeError, match="no sampler"):
            EngineCore.from_model(loaded, config)
    assert not loaded.model.summed and launched[0].closed.is_set()
    assert all(p.poll() is not None for p in launched[0].processes)
    core = EngineCore.from_model(loaded, config)
    try:
        assert _greedy(core, [[5, 6, 7]]) == _greedy(core, [[5, 6, 7]])
    finally:
        core.close()


def test_a_rank_that_cannot_load_its_share_fails_start_up_with_its_error(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    path = Path(shutil.copytree(model_dirs["tiny-llama"], tmp_path / "m"))
    config = _config(path)
    loaded = load_configured_model(config.model)  # rank 0's share, then the weights go
    (path / "model.safetensors").unlink()
    with pytest.raises(RankLost, match=r"rank 1 failed to start: .*has no \*\.safetensors"):
        EngineCore.from_model(loaded, config)


def test_what_a_split_model_does_without_is_refused_at_start_up(
    model_dirs: dict[str, Path], load: Callable[[str], LoadedModel]
) -> None:
    path = str(model_dirs["tiny-llama"])
    split = EngineConfig(ModelConfig(tensor_parallel_size=2))
    pd = ClusterConfig(prefill_instances=1, decode_instances=1)
    lending = ClusterConfig(instances=2, kv_lending="on")
    for served in (ClusterConfig(instances=2), pd, lending):  # (instances of a split model, PD engines, KV lending)
        check_serve_configs(split, ServerConfig(), served)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3: the model's 4 attention heads"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="loaded as 1 tensor-parallel rank"):
        EngineCore.from_model(load("tiny-llama"), _config(model_dirs["tiny-llama"]))


@pytest.mark.parametrize("error", [MemoryError("out of memory in layer 1"), KeyboardInterrupt()])
def test_a_failure_in_rank_0s_forward_pass_stops_the_engine(model_dirs: dict[str, Path], error: BaseException) -> None:
    """The other ranks are left part-way through the pass, waiting at a sum: no later pass may run (its sums would
    meet theirs out of step), so the step fails with :class:`RankLost` and every later one too. An interrupt (Ctrl-C
    in a notebook) is raised as itself, the ranks lost all the same: the next call fails, not answers wrongly."""
    config = _config(model_dirs["tiny-llama"])
    threads = torch.get_num_threads()
    core = EngineCore.from_model(load_configured_model(config.model), config)
    runner = core.executor.runner  # type: ignore[attr-defined]
    model = runner.model

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise error

    try:
        runner.model = failing
        core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
        raised = RankLost if isinstance(error, Exception) else type(error)
        with pytest.raises(raised):
            core.step()
        runner.model = model
        with pytest.raises(RankLost, match=rf"rank 0's forward pass failed \({type(error).__name__}"):
            _ranks(core).check()
        core.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RankLost):
            core.step()
    finally:
        runner.model = model
        core.close()
    assert torch.get_num_threads() == threads  # (rank 0's share of the threads is given back)


@pytest.mark.slow  # (6 s)
def test_one_loaded_network_is_rank_0_of_one_engine_at_a_time(model_dirs: dict[str, Path]) -> None:
    """A second engine on the same network would take over the first's sums (the first's steps would wait for ranks
    that never run them): refused; once the first is closed the network is free again."""
    config = _config(model_dirs["tiny-llama"])
    loaded = load_configured_model(config.model)
    first = EngineCore.from_model(loaded, config)
    with pytest.raises(ValueError, match="rank 0 of another tensor-parallel engine already"):
        EngineCore.from_model(loaded, config)
    prompts = [[5, 6, 7, 8]]
    answer = _greedy(first, prompts)
    first.close()
    second = EngineCore.from_model(loaded, config)
    try:
        assert _greedy(second, prompts) == answer
    finally:
        second.close()


def test_ranks_on_gpus_the_machine_lacks_are_refused_before_any_starts(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device cuda --tensor-parallel-size 2`` on a machine of one GPU: one line naming the flag and the rank, not a
    rank's start-up failing after the others loaded (CUDA is faked: the check runs before anything touches it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(ModelConfig(model=str(model_dirs["tiny-llama"]), device="cuda", tensor_parallel_size=2))
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 2: rank 1's device cuda:1: this machine has 1 GPU"):
        load_with_ranks(config)


def test_cpu_threads_are_shared_while_split_engines_run_and_given_back_after_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engines closed in another order than they opened: each later one's share was reckoned from the first's already
    cut count, and the first's close gave the process its whole count back while the second still ran."""
    from boundless.engine.tensor_parallel import CpuThreadShare

    counts = [8]
    monkeypatch.setattr(torch, "get_num_threads", lambda: counts[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: counts.__setitem__(0, n))
    share = CpuThreadShare()
    assert share.take(2) == 4 and counts[0] == 4
    assert share.take(2) == 4 and counts[0] == 4  # (from the 8 before the first, not the first's 4)
    share.give_back()
    assert counts[0] == 4  # (one engine still runs)
    share.give_back()
    assert counts[0] == 8


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_lora_adapters_on_two_ranks_answer_as_on_one_device(
    model_dirs: dict[str, Path], load: Callable[[str], LoadedModel], tmp_path: Path, dtype: str
) -> None:
    """Each rank applies its part of an adapter of every projection (B's rows of q/k/v and gate/up, A's columns of o
    and down, whose partial products are summed with the base model's): a batch mixing the adapter's requests and the
    base model's answers as one device does, on the native fp32 path and PyTorch's bf16 one; an adapter loaded while
    the engine runs reaches every rank, and one unloaded is gone from each."""
    from boundless.model.lora import LoRARequest
    from boundless.model.random_model import write_random_lora

    path = model_dirs["tiny-llama"]
    adapter = write_random_lora(tmp_path / "ad", load("tiny-llama").arch, std=0.3)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [5, 6, 7, 8, 9], [40, 41, 42, 43]]
    names = ["ad", None, None, "ad"]

    def answers(tp: int) -> list[list[int]]:
        config = EngineConfig(
            ModelConfig(model=str(path), max_model_len=256, tensor_parallel_size=tp, enable_lora=True, dtype=dtype),
            CacheConfig(kv_cache_gb=0.01),
        )
        core = EngineCore.from_model(load_configured_model(config.model), config)
        try:
            core.add_lora(LoRARequest("ad", 1, str(adapter)))
            out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
            for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
                core.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, lora_name=name))
            while core.has_unfinished():
                for delta in core.step():
                    out[delta.request_id].extend(delta.new_token_ids)
            assert core.remove_lora("ad")
            return [out[str(i)] for i in range(len(prompts))]
        finally:
            core.close()

    one, two = answers(1), answers(2)
    assert two == one
    assert one[0] != one[2]  # (the adapter changes the answer: a test that cannot tell them apart tests nothing)


@pytest.mark.slow  # (three ranks of the real model, 14 s)
def test_smollm2_from_its_gguf_file_on_three_ranks_answers_as_transformers(
    smollm2: LoadedModel, hf_model: Callable[[str], Any]
) -> None:
    """The bundled model (a GGUF file, its tensors cut from whole ones; 9 heads and 3 key/value heads: one a rank),
    three ranks summing through shared memory."""
    prompts = [smollm2.tokenizer.encode(t) for t in TEXTS[:4]]
    expected = _transformers_greedy(smollm2, hf_model("smollm2-135m"), prompts)
    config = EngineConfig(
        ModelConfig(max_model_len=256, tensor_parallel_size=3), CacheConfig(kv_cache_gb=0.01), SchedulerConfig()
    )
    core = EngineCore.from_model(load_configured_model(config.model), config)
    try:
        assert core.executor.runner.model.arch.num_kv_heads == 1  # type: ignore[attr-defined]
        assert _greedy(core, prompts) == expected
    finally:
        core.close()


@pytest.mark.slow  # (6 s of four ranks; the replicas are cut in tests/model/test_tensor_parallel.py)
def test_four_ranks_over_two_key_value_heads_answer_as_transformers(
    model_dirs: dict[str, Path], load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """More ranks than key/value heads: each rank one query head, its key/value head held by the two ranks whose query
    heads read it (vLLM's replication), their KV alike."""
    loaded = load("tiny-llama")
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS[:4]]
    expected = _transformers_greedy(loaded, hf_model("tiny-llama"), prompts)
    config = dataclasses.replace(
        _config(model_dirs["tiny-llama"]),
        model=dataclasses.replace(_config(model_dirs["tiny-llama"]).model, tensor_parallel_size=4),
    )
    core = EngineCore.from_model(load_configured_model(config.model), config)
    try:
        arch = core.executor.runner.model.arch  # type: ignore[attr-defined]
        assert (arch.num_heads, arch.num_kv_heads) == (1, 1)
        assert _greedy(core, prompts) == expected
    finally:
        core.close()


@pytest.mark.slow  # (3 s)
def test_prompt_logprobs_and_logprobs_on_two_ranks_are_one_devices(model_dirs: dict[str, Path]) -> None:
    """With the vocabulary split every rank computes its columns of the logits rank 0 computes, the prompt's rows
    among them (each rank scores the same spans in the same order): the figures are one device's, within rounding."""
    path = str(model_dirs["tiny-llama"])
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    outs = {}
    for tp in (1, 2):
        llm = LLM(path, max_model_len=256, kv_cache_gb=0.01, tensor_parallel_size=tp)
        try:
            outs[tp] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()
    for one, two in zip(outs[1], outs[2], strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.slow  # (5 s)
def test_an_8_bit_kv_cache_on_two_ranks_answers_as_on_one_device(model_dirs: dict[str, Path]) -> None:
    """``--kv-cache-dtype fp8``: each rank rounds its heads' keys and values as one device rounds them all, its swaps
    to host memory move them as bytes; the answers are one device's."""
    path = str(model_dirs["tiny-llama"])
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # (each grows from one block to three)
    answers = []
    for tp in (1, 2):
        llm = LLM(path, max_model_len=64, num_kv_blocks=4, kv_cache_dtype="fp8", tensor_parallel_size=tp)
        try:
            answers.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert llm.engine.scheduler.stats.num_swapped_out > 0  # (a pool of 4 blocks: requests took turns)
        finally:
            llm.close()
    assert answers[1] == answers[0]
