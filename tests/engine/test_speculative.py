"""Speculative decoding with n-gram proposals (``--speculative-config``): the proposer, the verification's
distribution, and the real engine giving the tokens plain decoding gives, in fewer steps."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch

from boundless.config import ConfigError, SchedulerConfig, SpeculativeConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.runner import StepLogits
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import ScheduledChunk, SchedulerOutput
from boundless.engine.speculative import NgramProposer, accepted_tokens
from boundless.engine.structured_output import StructuredOutput
from boundless.llm import LLM, engine_config
from boundless.model.loader import LoadedModel

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}  # tests/engine/test_suffix_decoding.py has its proposer
# Prompts that repeat themselves (an agent quoting a file, a list, a loop): the random model's greedy outputs loop too.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    list(range(20, 60)) + list(range(20, 30)),
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9],
    [100, 101, 102] * 12,
]


def _proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, lo, hi))


def test_the_tokens_after_the_latest_earlier_match_of_the_longest_suffix() -> None:
    p = _proposer()
    assert p.propose("r1", [1, 2, 3, 4, 9, 9, 1, 2, 3], 0, 10) == [4, 9, 9]  # suffix [1, 2, 3] at 0
    assert p.propose("r2", [5, 1, 2, 7, 1, 2, 8, 1, 2], 0, 10) == [8, 1, 2]  # [1, 2] at 1 and 4: the latest
    assert p.propose("r3", [7, 1, 2, 3, 8, 2, 3, 9, 1, 2, 3], 0, 10) == [8, 2, 3]  # 3 tokens match at 1, beating 2 at 5
    assert p.propose("r4", [1, 2, 3, 4, 5, 6], 0, 10) == []  # nothing repeats
    assert p.propose("r5", [1, 2, 3, 1, 2, 3, 1, 2], 0, 2) == [3, 1]  # the caller's limit
    assert _proposer(k=2).propose("r6", [1, 2, 3, 1, 2, 3, 1, 2], 0, 10) == [3, 1]  # num_speculative_tokens
    assert p.propose("r7", [4, 4], 0, 10) == [4]  # the match may end right before the suffix
    assert p.propose("r8", [4], 0, 10) == []


def test_lookup_bounds_and_word_alignment() -> None:
    assert _proposer(lo=2).propose("r9", [5, 1, 6, 1], 0, 10) == []  # one token matches, two are needed
    assert _proposer(lo=2).propose("r10", [5, 1, 6, 5, 1], 0, 10) == [6, 5, 1]
    # Token bytes that match across word boundaries are no match: 256 = 00 01 00 00, 1 = 01 00 00 00.
    assert _proposer(lo=1, hi=1).propose("r11", [256, 0, 7, 1], 0, 10) == []
    assert _proposer(lo=1, hi=1).propose("r12", [256, 0, 1, 7, 1], 0, 10) == [7, 1]


def test_a_requests_packing_is_extended_by_its_new_tokens_and_dropped() -> None:
    p = _proposer()
    tokens = [1, 2, 3, 4, 5]
    assert p.propose("a", tokens, 0, 10) == []
    tokens += [1, 2]  # the request's outputs: its packing grows by them
    assert p.propose("a", tokens, 0, 10) == [3, 4, 5] == _proposer().propose("b", tokens, 0, 10)
    p.finish("a", tokens, 0)
    assert p.propose("a", [7, 8, 7], 0, 10) == [8, 7]  # a new request under the same id starts afresh


def test_accepted_tokens_keep_samples_through_the_first_mismatch() -> None:
    assert accepted_tokens([4, 5, 6], [4, 5]) == 3  # both drafts matched: a bonus token
    assert accepted_tokens([4, 6, 6], [4, 5]) == 2  # the second draft rejected: 6 corrects it
    assert accepted_tokens([3, 5, 6], [4, 5]) == 1  # the first rejected: a later match does not count
    assert accepted_tokens([3], []) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle'"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "exceed"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown keys ['model']"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size must"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}',
            "the first range must start at 1",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens_per_batch_size": [[1, 4, 8], [3, 8, 2]]}',
            "[3, 8, 2] must start after the range before it",
        ),
        ('{"method": "suffix", "num_speculative_tokens_per_batch_size": [[1, 4]]}', "must be a non-empty list"),
    ],
)
def test_a_bad_config_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SchedulerConfig(speculative_config=text)
    assert message in str(e.value)


def test_vllms_defaults_and_forms() -> None:
    def parse(**spec: object) -> SpeculativeConfig:
        return SpeculativeConfig.parse(json.dumps({"method": "ngram", "num_speculative_tokens": 3, **spec}))

    assert parse() == SpeculativeConfig("ngram", 3, 5, 5)
    assert parse(disable_by_batch_size=8) == SpeculativeConfig("ngram", 3, 5, 5, 8)
    assert parse(prompt_lookup_max=4) == SpeculativeConfig("ngram", 3, 4, 4)
    assert parse(prompt_lookup_min=2) == SpeculativeConfig("ngram", 3, 2, 2)
    # vLLM's dynamic speculative decoding: a gap and the sizes past the last range take the range before; never
    # above num_speculative_tokens; disable_by_batch_size over it.
    schedule = parse(num_speculative_tokens_per_batch_size=[[1, 1, 8], [2, 4, 2], [9, 16, 0], [17, 32, 1]])
    assert [schedule.max_drafts(n) for n in (1, 2, 4, 5, 8, 9, 16, 17, 500)] == [3, 2, 2, 2, 2, 0, 0, 1, 1]
    assert parse(disable_by_batch_size=8).max_drafts(8) == 3 and parse(disable_by_batch_size=8).max_drafts(9) == 0
    with pytest.raises(ConfigError, match="num-scheduler-steps"):
        SchedulerConfig(speculative_config=json.dumps(NGRAM), num_scheduler_steps=4)
    # LLM(speculative_config={...}), vLLM's offline form, is the flag's JSON.
    config = engine_config("m", speculative_config=NGRAM)
    assert config.scheduler.speculative == SpeculativeConfig("ngram", 4, 1, 3)


def _core(loaded: LoadedModel, spec: dict | None, num_blocks: int = 64, **cache: object) -> EngineCore:
    options = {"max_model_len": min(256, num_blocks * 16), "num_kv_blocks": num_blocks, "policy": "fcfs", **cache}
    if spec is not None:
        options["speculative_config"] = spec
    return EngineCore.from_model(loaded, engine_config("m", **options))


def _run(core: EngineCore, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> tuple[dict, dict, int]:
    """Each request's tokens and (finish reason, stop reason), and the steps that gave some request tokens (summed
    over the requests); checks between steps that a request holds the blocks of its tokens with KV and at most those
    of its drafts more."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, tuple] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"] = []
    steps = 0
    while core.has_unfinished():
        for delta in core.step():
            steps += 1
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finished:
                reasons[delta.request_id] = (delta.finish_reason, delta.stop_reason)
        for request in core.scheduler.running:
            held = core.kv.num_allocated_blocks(request.request_id)
            assert core.kv.blocks_for_tokens(request.num_computed_tokens) <= held
            assert held <= core.kv.blocks_for_tokens(request.num_tokens + 4)
    assert core.kv.pool.num_used == 0  # every block given back
    return tokens, reasons, steps


def _greedy(max_tokens: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [pytest.param(NGRAM, id="ngram"), pytest.param(SUFFIX, id="suffix")])
@pytest.mark.parametrize(
    "cache",
    [
        pytest.param({}, id="prefix-cache"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({"num_blocks": 12, "kv_host_gb": 0}, id="preempted-recomputed"),
        pytest.param({"num_blocks": 12}, id="preempted-swapped"),
    ],
)
def test_greedy_tokens_are_plain_decodings_in_fewer_steps(tiny_llama: LoadedModel, cache: dict, spec: dict) -> None:
    plain = _run(_core(tiny_llama, None, **cache), _greedy())
    core = _core(tiny_llama, spec, **cache)
    spec = _run(core, _greedy())
    assert spec[0] == plain[0]
    assert spec[1] == plain[1]
    stats = core.stats()
    assert stats.spec_accepted_tokens > 0
    if spec is NGRAM:  # (suffix decoding proposes little over a random model's outputs, and none of it wrong here)
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert 0 < stats.spec_drafts <= stats.spec_draft_tokens <= 4 * stats.spec_drafts
    by_position = stats.spec_accepted_by_position  # a draft is kept only after those before it
    assert sum(by_position) == stats.spec_accepted_tokens and by_position == sorted(by_position, reverse=True)
    assert spec[2] < plain[2]  # accepted drafts are tokens without a step of their own
    assert stats.generation_tokens == sum(len(t) for t in plain[0].values())
    if "num_blocks" in cache:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize(
    "limit",
    [
        pytest.param({"disable_by_batch_size": len(PROMPTS) - 1}, id="disable_by_batch_size"),
        pytest.param({"num_speculative_tokens_per_batch_size": [[1, 2, 4], [4, 64, 0]]}, id="per-batch-size"),
    ],
)
def test_no_drafts_in_a_batch_over_the_limit(tiny_llama: LoadedModel, limit: dict) -> None:
    core = _core(tiny_llama, {**NGRAM, **limit})
    tokens, _, _ = _run(core, _greedy())
    # The 4 requests decode together to their 40th token, every step over the limit: no drafts.
    assert core.stats().spec_draft_tokens == 0
    alone = _core(tiny_llama, {**NGRAM, **limit})
    assert _run(alone, _greedy(), PROMPTS[:3])[0] == {rid: tokens[rid] for rid in ("r0", "r1", "r2")}
    assert alone.stats().spec_accepted_tokens > 0  # 3 requests: within the limit (3 takes the range before's 4)


def test_prefix_blocks_named_after_speculation_hold_the_right_kv(tiny_llama: LoadedModel) -> None:
    """A second round of prompts that extend the first round's outputs: their cached prefixes were named after
    steps with drafts (some rejected), and must give the tokens a fresh engine gives."""
    core = _core(tiny_llama, NGRAM)
    first, _, _ = _run(core, _greedy())
    longer = [prompt + first[f"r{i}"] for i, prompt in enumerate(PROMPTS)]
    again, _, _ = _run(core, _greedy(24), longer)
    assert core.stats().prefix_cache_hits > 0
    fresh, _, _ = _run(_core(tiny_llama, None, enable_prefix_caching=False), _greedy(24), longer)
    assert again == fresh


def test_stops_and_lengths_inside_accepted_drafts_are_exact(tiny_llama: LoadedModel) -> None:
    plain, _, _ = _run(_core(tiny_llama, None), _greedy())
    # A token each request's output holds past its start: the stop falls inside a step's accepted tokens.
    stop = sorted({t for out in plain.values() for t in out[3:12]})[:6]
    params = SamplingParams(temperature=0.0, max_tokens=37, stop_token_ids=stop)
    plain = _run(_core(tiny_llama, None), params)
    spec = _run(_core(tiny_llama, NGRAM), params)
    assert spec[:2] == plain[:2]
    assert {reason for reason, _ in plain[1].values()} == {"stop", "length"}


def test_logprobs_of_accepted_tokens_are_the_models(tiny_llama: LoadedModel) -> None:
    params = _greedy(24, logprobs=3)
    outs = []
    for spec in (None, NGRAM):
        core = _core(tiny_llama, spec)
        for i, prompt in enumerate(PROMPTS):
            core.add_request(f"r{i}", prompt, params)
        got: dict[str, list] = {}
        while core.has_unfinished():
            for delta in core.step():
                got.setdefault(delta.request_id, []).extend(delta.new_logprobs)
        outs.append(got)
    plain, spec = outs
    assert spec.keys() == plain.keys()
    for rid in plain:
        assert [t.token_id for t in spec[rid]] == [t.token_id for t in plain[rid]]
        assert [t.rank for t in spec[rid]] == [t.rank for t in plain[rid]]
        assert [t.logprob for t in spec[rid]] == pytest.approx([t.logprob for t in plain[rid]], abs=1e-4)
        for a, b in zip(spec[rid], plain[rid], strict=True):
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]


def test_verification_samples_from_the_models_distribution(tiny_llama: LoadedModel) -> None:
    """Chunks with two drafts over fixed logits, sampled 6,000 times through the runner: the first token is drawn
    from position 0's distribution whatever the drafts, a draft is kept with its probability under the model, and
    the token after a kept draft from the next position's distribution (speculative sampling's guarantee)."""
    runner = _core(tiny_llama, NGRAM).executor.runner  # type: ignore[attr-defined]
    vocab = tiny_llama.arch.vocab_size
    probs = torch.zeros(3, vocab)
    probs[0, [4, 5, 6]] = torch.tensor([0.5, 0.3, 0.2])  # the first draft (5) has probability 0.3
    probs[1, [7, 8]] = torch.tensor([0.6, 0.4])  # the second (7): 0.6
    probs[2, [9, 10]] = torch.tensor([0.25, 0.75])
    params = SamplingParams(temperature=1.0, max_tokens=10)
    chunks = [
        ScheduledChunk(f"r{i}", [3, 5, 7], 20, [0, 1], True, params, 4, (), draft_token_ids=(5, 7)) for i in range(1000)
    ]
    batch = runner.build_batch(SchedulerOutput(chunks=chunks))
    assert [c.num_output_tokens for c in batch.sample_chunks[:3]] == [4, 5, 6]  # each row counts the drafts before it
    assert batch.sample_indices.tolist() == list(range(3000))
    logits = torch.log(probs.clamp_min(1e-30)).repeat(1000, 1).to(tiny_llama.device)  # where the model's logits are
    n = 6000
    first, after_five, third, lengths = Counter(), Counter(), Counter(), Counter()
    for _ in range(n // 1000):
        tokens, later = runner.sample(StepLogits(logits, batch.sample_chunks))
        for rid, token in tokens.items():
            out = [token.token_id] + [t.token_id for t in later[rid]]
            first[out[0]] += 1
            lengths[len(out)] += 1
            if out[0] == 5:
                after_five[out[1]] += 1
                if out[1] == 7:
                    third[out[2]] += 1
    assert set(first) == {4, 5, 6} and set(after_five) <= {7, 8} and set(third) <= {9, 10}
    for token, p in ((4, 0.5), (5, 0.3), (6, 0.2)):
        assert first[token] / n == pytest.approx(p, abs=0.025)
    kept_five = first[5]
    assert after_five[7] / kept_five == pytest.approx(0.6, abs=0.04)
    assert third[10] / after_five[7] == pytest.approx(0.75, abs=0.05)
    # A token after each rejection, and a bonus token after both drafts were kept.
    assert lengths[1] == n - kept_five and lengths[3] == after_five[7]


def test_seeded_sampling_repeats_and_speculates(tiny_llama: LoadedModel) -> None:
    params = SamplingParams(temperature=0.7, max_tokens=30, seed=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        core = _core(tiny_llama, NGRAM)
        runs.append(_run(core, params)[0])
        assert core.stats().spec_draft_tokens > 0
    assert runs[0] == runs[1]
    assert all(len(t) == 30 for t in runs[0].values())


@pytest.mark.parametrize("spec", [pytest.param(NGRAM, id="ngram"), pytest.param(SUFFIX, id="suffix")])
def test_seeded_samples_are_the_unspeculated_ones(tiny_llama: LoadedModel, spec: dict) -> None:
    """A seeded request's samples are its own whatever was drafted: those of the same request without speculation,
    drafts rejected along the way and all (a rejected draft's later rows draw nothing from its generator)."""
    params = SamplingParams(temperature=0.1, max_tokens=30, seed=3, ignore_eos=True)
    plain = _run(_core(tiny_llama, None), params)[0]
    core = _core(tiny_llama, spec)
    _run(core, dataclasses.replace(params, seed=4))  # (outputs that suffix decoding drafts from, not all kept)
    assert _run(core, params)[0] == plain
    stats = core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # drafts kept and drafts rejected


@pytest.mark.parametrize("spec", [pytest.param(NGRAM, id="ngram"), pytest.param(SUFFIX, id="suffix")])
def test_served_greedy_completions_and_metrics(tiny_llama: LoadedModel, model_dirs: dict, spec: dict) -> None:
    openai = pytest.importorskip("openai")  # (a device machine may have no server packages: scripts/gpu-check.sh)
    pytest.importorskip("fastapi")
    from boundless.api.launch import start_in_thread

    path = str(model_dirs["tiny-llama"])
    options = {"max_model_len": 512, "kv_cache_gb": 0.05, "seed": 0}
    greedy = {"max_tokens": 40, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    offline = LLM(path, **options)
    try:
        expected = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    finally:
        offline.close()
    engine = AsyncEngine(EngineCore.from_model(tiny_llama, engine_config(path, speculative_config=spec, **options)))
    server = start_in_thread(engine, "tiny")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model="tiny", prompt=prompt, **greedy)
        chunks = client.completions.create(model="tiny", prompt=prompt, stream=True, **greedy)
        streamed = "".join(c.choices[0].text for c in chunks)
        metrics = openai.DefaultHttpxClient().get(server.url + "/metrics").text
    finally:
        server.stop()
        engine.shutdown()
    assert got.choices[0].text == streamed == expected[0].outputs[0].text
    assert got.usage.completion_tokens == 40
    assert 'boundless_spec_decode_accepted_tokens_per_position_total{instance="0",position="0"}' in metrics
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        lines = [line for line in metrics.splitlines() if line.startswith(f"boundless_spec_decode_{name}_total")]
        assert lines and float(lines[0].split()[-1]) > 0


def test_penalties_count_the_drafts_before_each_position(tiny_llama: LoadedModel) -> None:
    """A penalized request's later positions see the drafts before them as output, and only the tokens kept are
    counted after the step: over fixed logits, the draft's own count turns the second position's choice."""
    runner = _core(tiny_llama, NGRAM).executor.runner  # type: ignore[attr-defined]
    logits = torch.full((3, tiny_llama.arch.vocab_size), -5.0)
    logits[0, 5] = 3.0  # the first draft (5) is the model's choice
    logits[1, 5], logits[1, 6] = 3.0, 2.9  # 5 again, unless the kept draft's count (0.5) takes it below 6
    logits[2, 7] = 3.0
    params = SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=0.5)
    history = [1, 2, 3, 9]  # prompt [1, 2, 3], one output (9) before the step
    chunk = ScheduledChunk("r", [9, 5, 5], 3, [0], True, params, 1, (), history=history, num_prompt_tokens=3)
    chunk = dataclasses.replace(chunk, draft_token_ids=(5, 5))
    batch = runner.build_batch(SchedulerOutput(chunks=[chunk]))
    tokens, later = runner.sample(StepLogits(logits, batch.sample_chunks))
    assert [tokens["r"].token_id] + [t.token_id for t in later["r"]] == [5, 6]  # the second draft is rejected
    counts = runner.sampler._counts["r"]
    assert counts.output == {9: 1, 5: 1, 6: 1} and counts.num_output_tokens == 3  # the kept tokens only


def test_penalized_greedy_tokens_are_plain_decodings(tiny_llama: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=0.2)
    plain = _run(_core(tiny_llama, None), params)
    core = _core(tiny_llama, NGRAM)
    assert _run(core, params)[:2] == plain[:2]
    assert core.stats().spec_accepted_tokens > 0


def test_the_simulator_refuses_it() -> None:
    from boundless.sim.engine import SimulatedModel, simulated_engine
    from boundless.sim.profiles import load_profile

    config = engine_config("smollm2-135m", speculative_config=NGRAM, num_kv_blocks=64)
    with pytest.raises(ConfigError, match="does not model speculative decoding"):
        simulated_engine(config, SimulatedModel.read(config.model), load_profile("cpu").step, lambda: 0.0)


FOX = "the quick brown fox jumps over the lazy dog"
CHOICES = [FOX, "a slow green turtle walks under the busy cat"]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": CHOICES}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "structured",
    [
        pytest.param(lambda: StructuredOutput.choice(CHOICES), id="choice"),
        pytest.param(lambda: StructuredOutput.json_schema(JSON_SCHEMA), id="json-schema"),
    ],
)
def test_a_grammars_drafts_are_checked_against_it(tiny_llama: LoadedModel, structured) -> None:
    """Drafts under a grammar: each position's mask is the grammar's after the drafts before it, a draft it refuses is
    never kept, and the matcher goes on from the tokens kept; so the output is plain structured decoding's."""
    pytest.importorskip("xgrammar")
    spec = structured()
    tokenizer = tiny_llama.tokenizer
    prompts = [tokenizer.encode(f"Say it: {FOX}. Again: {FOX}. Once more:"), tokenizer.encode(f"{FOX}, {FOX}, {FOX}")]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured=spec)]
    params.append(SamplingParams(temperature=0.8, max_tokens=60, structured=spec, seed=5))
    outs = []
    for config in (None, NGRAM):
        core = _core(tiny_llama, config, num_blocks=64)
        texts, reasons = {}, {}
        for i, prompt in enumerate(prompts):
            for j, p in enumerate(params):
                core.add_request(f"r{i}{j}", prompt, p)
                texts[f"r{i}{j}"] = ""
        while core.has_unfinished():
            for delta in core.step():
                texts[delta.request_id] += delta.new_text
                reasons[delta.request_id] = delta.finish_reason
        outs.append((texts, core.stats()))
    (plain, _), (spec_texts, stats) = outs
    assert stats.spec_accepted_tokens > 0
    greedy = {rid: t for rid, t in spec_texts.items() if rid.endswith("0")}
    assert greedy == {rid: plain[rid] for rid in greedy}
    for rid, text in spec_texts.items():  # sampled ones differ from plain draws, but keep to the grammar
        if spec.kind == "choice":
            assert text in CHOICES
        elif reasons[rid] == "stop":  # (a random model's JSON may pad with blanks to the length limit)
            assert json.loads(text)["name"] in CHOICES
