"""Structured outputs on the real engine: outputs held to a JSON schema (a random model's too, whose free output is
noise), with multi-step windows, after a handoff's replay, and bad specs refused before anything is queued."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine import async_engine as async_engine_module
from boundless.engine import core as core_module
from boundless.engine import structured_output as structured_output_module
from boundless.engine.async_engine import EngineLoop
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampler import Sampler
from boundless.engine.sampling_params import InvalidSamplingParams, SamplingParams
from boundless.engine.scheduler import ScheduledChunk
from boundless.engine.structured_output import Grammars, StructuredOutput, check_structured_output
from boundless.model.loader import LoadedModel

# `make test` installs xgrammar; a device machine has it only when its wheels travel (scripts/gpu-check.sh).
pytest.importorskip("xgrammar")

# A finite language but for whitespace: what a random model writes under it must still parse and validate.
COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": COLORS}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def _engine(loaded: LoadedModel, windows: int = 1, speculative: str | None = None) -> EngineCore:
    cfg = EngineConfig(
        model=ModelConfig(max_model_len=512),
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(num_scheduler_steps=windows, speculative_config=speculative),
    )
    return EngineCore.from_model(loaded, cfg)


def _run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[str, str]]:
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    text = dict.fromkeys(requests, "")
    reasons: dict[str, str] = {}
    while core.has_unfinished():
        for delta in core.step():
            text[delta.request_id] += delta.new_text
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason or ""
    return {rid: (text[rid], reasons[rid]) for rid in requests}


def _requests(loaded: LoadedModel, spec: StructuredOutput, count: int) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = [loaded.tokenizer.encode(f"Item {i}: a color, please.") for i in range(count)]
    return {
        # Greedy and sampled rows, each with a seed of its own.
        f"r{i}": (p, SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=200, structured=spec))
        for i, p in enumerate(prompts)
    }


@pytest.mark.parametrize("windows", [1, 4])
def test_a_random_models_outputs_follow_the_schema(tiny_llama: LoadedModel, windows: int) -> None:
    spec = StructuredOutput.json_schema(SCHEMA)
    requests = _requests(tiny_llama, spec, 6)
    requests["free"] = (tiny_llama.tokenizer.encode("Item: a color"), SamplingParams(temperature=0.0, max_tokens=24))
    out = _run(_engine(tiny_llama, windows), requests)
    for rid in requests:
        if rid == "free":
            continue
        text, reason = out[rid]
        assert reason == "stop", f"{rid}: {text!r} ended with {reason}"
        value = json.loads(text)
        assert set(value) == {"color", "ok"} and value["color"] in COLORS and isinstance(value["ok"], bool)
    free_text = out["free"][0]
    with pytest.raises(ValueError):  # the same model unconstrained writes no JSON (else this test proves nothing)
        json.loads(free_text)


def test_multi_step_windows_give_the_tokens_of_single_steps(tiny_llama: LoadedModel) -> None:
    spec = StructuredOutput("json_object")
    prompts = [tiny_llama.tokenizer.encode(f"Object {i}:") for i in range(4)]
    requests = {
        f"g{i}": (p, SamplingParams(temperature=0.0, max_tokens=40, structured=spec)) for i, p in enumerate(prompts)
    }
    single = _run(_engine(tiny_llama, 1), requests)
    windowed = _run(_engine(tiny_llama, 8), requests)
    assert windowed == single
    assert all(text.lstrip().startswith("{") for text, _ in single.values()), single


def test_a_request_waits_for_its_grammar_while_the_others_step(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar compiles off the engine's steps (the first one reads the vocabulary: seconds for a real model's):
    its request is not admitted until it is, and the engine's other requests run meanwhile."""
    core = _engine(tiny_llama)
    assert core.grammars is not None
    gate = threading.Event()
    compile_grammar = core.grammars._compile

    def held_compile(spec: StructuredOutput) -> object:
        assert gate.wait(30)
        return compile_grammar(spec)

    monkeypatch.setattr(core.grammars, "_compile", held_compile)
    encode = tiny_llama.tokenizer.encode
    spec = StructuredOutput.json_schema(SCHEMA)
    core.add_request("json", encode("A color:"), SamplingParams(temperature=0.0, max_tokens=200, structured=spec))
    core.add_request("free", encode("Some text"), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    free: list[int] = []
    while len(free) < 8:
        for delta in core.step():
            assert delta.request_id == "free"
            free.extend(delta.new_token_ids)
    waiting = core.scheduler.requests["json"]
    assert waiting.num_computed_tokens == 0 and not waiting.output_token_ids
    assert core.step() == []  # nothing else to run: waits (bounded) for the grammar, which is held
    gate.set()
    text = ""
    while core.has_unfinished():
        for delta in core.step():
            text += delta.new_text
    value = json.loads(text)
    assert value["color"] in COLORS
    # A second request of the same schema finds it compiled: admitted at once.
    core.add_request("again", encode("Another:"), SamplingParams(temperature=0.0, max_tokens=200, structured=spec))
    assert not core.scheduler.compiling and core.step()


def test_a_request_first_seen_with_outputs_is_replayed_into_its_grammar(tiny_llama: LoadedModel) -> None:
    """A decode engine takes over a request with the prefill engine's first tokens: its matcher starts from them."""
    tokenizer = tiny_llama.tokenizer
    prompt = tokenizer.encode("A color:")
    started = tokenizer.encode('{"color": "gr')
    _assert_only_greens_rest_comes_next(tiny_llama, prompt, started, StructuredOutput.json_schema(SCHEMA))


def _assert_only_greens_rest_comes_next(
    loaded: LoadedModel, prompt: list[int], started: list[int], spec: StructuredOutput
) -> None:
    """A sampler that first sees the request with ``started`` as its outputs (a handoff), whose JSON so far ends in
    ``"gr``, draws only the rest of "green" whatever the logits favour."""
    tokenizer = loaded.tokenizer
    sampler = Sampler(torch.device("cpu"), grammars=Grammars(tokenizer, loaded.arch.vocab_size))
    chunk = ScheduledChunk(
        "r",
        [started[-1]],
        len(prompt) + len(started) - 1,
        [0],
        True,
        SamplingParams(temperature=1.0, seed=0, structured=spec),
        len(started),
        (),
        history=prompt + started,
        num_prompt_tokens=len(prompt),
    )
    for seed in range(8):
        logits = torch.randn(1, loaded.arch.vocab_size, generator=torch.Generator().manual_seed(seed))
        token = Sampler.sample(sampler, logits, [chunk])[0].token_id
        sampler.forget(["r"])
        assert 'een"'.startswith(tokenizer.decode([token])), tokenizer.decode([token])


def test_bad_specs_are_refused_before_anything_is_queued(tiny_llama: LoadedModel) -> None:
    core = _engine(tiny_llama)
    prompt = tiny_llama.tokenizer.encode("x")
    with pytest.raises(InvalidRequestError) as err:
        core.add_request("a", prompt, SamplingParams(structured=StructuredOutput.json_schema({"type": 5})))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(ignore_eos=True, structured=StructuredOutput("json_object"))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        StructuredOutput("json_schema")  # without its schema
    assert not core.has_unfinished()


@pytest.mark.parametrize(
    "spec",
    [StructuredOutput("grammar", "root ::= root"), StructuredOutput("regex", "[^\\x00-\\U0010ffff]")],
)
def test_a_grammar_that_allows_no_output_is_refused(tiny_llama: LoadedModel, spec: StructuredOutput) -> None:
    """A grammar with no first token (nor an end) would leave every step nothing to take: refused up front (a 400)."""
    with pytest.raises(InvalidRequestError, match="allows no output"):
        _engine(tiny_llama).add_request("a", tiny_llama.tokenizer.encode("x"), SamplingParams(structured=spec))


@pytest.mark.parametrize("speculative", [None, '{"method": "ngram", "num_speculative_tokens": 3}'])
def test_a_grammar_at_a_dead_end_ends_its_request_alone(tiny_llama: LoadedModel, speculative: str | None) -> None:
    """A grammar that allows a first character and then nothing: its request ends there (its end token), and the
    requests stepping beside it, greedy and sampled, are served as if it were not there; before, the step failed and
    took them with it."""
    dead = StructuredOutput("regex", "a[^\\x00-\\U0010ffff]")
    prompt = tiny_llama.tokenizer.encode("Say something.")
    others = {
        "greedy": (prompt, SamplingParams(temperature=0.0, max_tokens=12)),
        "sampled": (prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=12)),
    }
    alone = _run(_engine(tiny_llama, speculative=speculative), others)
    ends = {"greedy-dead": SamplingParams(temperature=0.0, structured=dead), "sampled-dead": None}
    ends["sampled-dead"] = SamplingParams(temperature=1.0, seed=1, structured=dead)
    together = _run(
        _engine(tiny_llama, speculative=speculative), others | {rid: (prompt, p) for rid, p in ends.items()}
    )
    assert {rid: together[rid] for rid in others} == alone
    assert together["greedy-dead"] == ("a", "stop") and together["sampled-dead"] == ("a", "stop")


@pytest.mark.parametrize("speculative", [None, '{"method": "ngram", "num_speculative_tokens": 3}'])
def test_a_grammar_that_allowed_tokens_or_bad_words_leave_nothing_ends_its_request_alone(
    tiny_llama: LoadedModel, speculative: str | None
) -> None:
    """``allowed_token_ids`` none of which the grammar allows, or ``bad_words`` that ban the one token it allows: the
    row has no token left, so the request takes its end token and ends (the grammar told of the dead end), and the
    requests stepping beside it are served as if it were not there; before, the grammar refused the end token (or the
    row of no token failed to draw) and the step failed with every request in it."""
    tokenizer = tiny_llama.tokenizer
    prompt = tokenizer.encode("Say something.")
    others = {
        "greedy": (prompt, SamplingParams(temperature=0.0, max_tokens=12)),
        "sampled": (prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=12)),
    }
    alone = _run(_engine(tiny_llama, speculative=speculative), others)
    letter_a = StructuredOutput("regex", "a")
    masked = {
        "allowed": SamplingParams(temperature=0.0, structured=letter_a, allowed_token_ids=tokenizer.encode("xyz")),
        "bad-words": SamplingParams(temperature=1.0, seed=1, structured=letter_a, bad_words=["a"]),
    }
    together = _run(
        _engine(tiny_llama, speculative=speculative), others | {rid: (prompt, p) for rid, p in masked.items()}
    )
    assert {rid: together[rid] for rid in others} == alone
    assert together["allowed"] == ("", "stop") and together["bad-words"] == ("", "stop")


@pytest.mark.parametrize(
    ("spec", "valid"),
    [
        (StructuredOutput("regex", "[a-c]{3}-[0-9]{2}"), lambda text: re.fullmatch("[a-c]{3}-[0-9]{2}", text)),
        (
            StructuredOutput.choice(["yes", "no", 'a "quoted" maybe']),
            lambda text: text in ("yes", "no", 'a "quoted" maybe'),
        ),
        (
            StructuredOutput("grammar", 'root ::= ("ab" | "cd") [0-9] "!"'),
            lambda text: re.fullmatch("(ab|cd)[0-9]!", text),
        ),
    ],
)
def test_regex_choice_and_grammar_outputs_of_a_random_model(tiny_llama: LoadedModel, spec, valid) -> None:
    out = _run(_engine(tiny_llama), _requests(tiny_llama, spec, 4))
    for rid, (text, reason) in out.items():
        assert reason == "stop" and valid(text), f"{rid}: {text!r} ({reason})"
    assert len({text for text, _ in out.values()}) > 1 or spec.kind == "choice"  # sampled rows differ


@pytest.mark.parametrize("spec", [("regex", "[a-"), ("grammar", "root ::= missing"), ("json_schema", "{not json")])
def test_definitions_xgrammar_cannot_read_are_refused(tiny_llama: LoadedModel, spec: tuple[str, str]) -> None:
    core = _engine(tiny_llama)
    with pytest.raises(InvalidRequestError) as err:
        core.add_request(
            "a", [1, 2], SamplingParams(structured=StructuredOutput(spec[0], spec[1], "structured_outputs"))
        )
    assert err.value.param == "structured_outputs" and spec[0] in str(err.value)


def test_grammars_xgrammar_builds_but_cannot_compile_are_refused(tiny_llama: LoadedModel) -> None:
    """A schema's negative ``minLength`` builds a grammar that xgrammar's compiler refuses: compiled in an engine's
    step, it failed the step's every request. The check compiles it for a stand-in of the model's vocabulary: the
    request is refused as it is added, its message without xgrammar's log prefix; a grammar that names token ids
    (``TokenTagDispatch``) passes within the vocabulary and is refused past it."""
    core = _engine(tiny_llama)
    bad = StructuredOutput.json_schema({"type": "string", "minLength": -5})
    with pytest.raises(InvalidRequestError) as err:
        core.add_request("a", [1, 2], SamplingParams(structured=bad))
    assert err.value.param == "response_format" and "-5" in str(err.value)
    assert "/project/" not in str(err.value) and not core.has_unfinished()
    vocab = tiny_llama.arch.vocab_size
    named = StructuredOutput("grammar", f'root ::= TokenTagDispatch(({vocab - 1}, a))\na ::= "x"', "structured_outputs")
    check_structured_output(named, vocab)
    with pytest.raises(InvalidRequestError):
        check_structured_output(named, vocab - 1)


def test_a_grammar_that_fails_to_compile_in_the_engine_fails_its_request_alone(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a grammar pass the check and fail the engine's compilation, its request ends with an error between
    steps (``take_rejected``) and the others run on; in a step, the sampler raised for it and failed every request
    of the step. A request of that grammar that comes after the failure is refused as it is added."""
    monkeypatch.setattr(core_module, "check_structured_output", lambda spec, vocab_size: None)  # (as if it passed)
    core = _engine(tiny_llama)
    assert core.grammars is not None
    gate, compile_grammar = threading.Event(), core.grammars._compile

    def held_compile(spec: StructuredOutput) -> object:
        assert gate.wait(30)  # (until the request is queued: its compilation fails in the background)
        return compile_grammar(spec)

    monkeypatch.setattr(core.grammars, "_compile", held_compile)
    bad = StructuredOutput.json_schema({"type": "string", "minLength": -5})
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core.add_request("free", [1, 2, 3], free)
    core.add_request("bad", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, structured=bad))
    assert "bad" in core.scheduler.compiling
    gate.set()
    ends: dict[str, tuple[str | None, str | int | None, int]] = {}
    while core.has_unfinished():
        for delta in core.step():
            if delta.finished:
                ends[delta.request_id] = (delta.finish_reason, delta.stop_reason, delta.num_output_tokens)
    assert ends["free"] == ("length", None, 8)
    reason, why, outputs = ends["bad"]
    assert reason == "error" and outputs == 0 and "response_format: the json_schema cannot be used" in str(why)
    prompt_tokens = core.stats().prompt_tokens
    with pytest.raises(InvalidRequestError) as err:
        core.add_request("again", [1, 2, 3], SamplingParams(structured=bad))
    assert err.value.param == "response_format" and not core.has_unfinished()
    assert core.stats().prompt_tokens == prompt_tokens  # refused before anything was set up for it


def test_the_served_loop_sends_a_failed_grammars_error_and_serves_on(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's loop sends the error of a request whose grammar failed to compile in the engine (its final delta,
    taken as the step is decided); the other request is served."""
    for module in (core_module, async_engine_module):
        monkeypatch.setattr(module, "check_structured_output", lambda spec, vocab_size: None)  # (as if it passed)
    core = _engine(tiny_llama)
    assert core.grammars is not None
    gate, compile_grammar = threading.Event(), core.grammars._compile
    monkeypatch.setattr(core.grammars, "_compile", lambda spec: gate.wait(30) and compile_grammar(spec))
    finals: dict[str, RequestDelta] = {}
    both = threading.Event()

    def sink(delta: RequestDelta) -> None:
        if delta.finished:
            finals[delta.request_id] = delta
            if len(finals) == 2:
                both.set()

    loop = EngineLoop(core, sink)
    try:
        bad = StructuredOutput.json_schema({"type": "string", "minLength": -5})
        loop.add("bad", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, structured=bad))
        loop.add("free", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        gate.set()
        assert both.wait(60)
        assert finals["bad"].finish_reason == "error" and "cannot be used" in str(finals["bad"].stop_reason)
        assert finals["free"].finish_reason == "length" and loop.is_alive()
    finally:
        loop.shutdown()


def _free_greedy(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    core = _engine(loaded)
    core.add_request("free", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens += delta.new_token_ids
    return tokens


@pytest.mark.parametrize(
    ("windows", "speculative"),
    [(1, None), (4, None), (1, '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}')],
    ids=["steps", "windows", "speculative"],
)
def test_a_grammar_that_begins_after_given_tokens(tiny_llama: LoadedModel, windows: int, speculative: str) -> None:
    """A reasoning model's grammar waits for its end of thinking (``after``): until then the output is the model's
    own, token for token; then it follows the grammar. A grammar whose ``after`` never comes holds nothing. In
    multi-step windows and with speculative drafts (none while the grammar waits) alike."""
    tokenizer = tiny_llama.tokenizer
    prompt = tokenizer.encode("Think first, then answer:")
    free = _free_greedy(tiny_llama, prompt, 24)
    # The "end of thinking": the free output's fourth token and the one after it (a tag of two tokens), where they
    # first occur.
    after = tuple(free[3:5])
    at = next(i for i in range(len(free)) if tuple(free[i : i + 2]) == after)
    spec = StructuredOutput("regex", "[a-z]{6}", "structured_outputs", after=after)
    unseen = next(t for t in range(tiny_llama.arch.vocab_size) if t not in free)
    never = StructuredOutput("regex", "[a-z]{6}", "structured_outputs", after=(unseen,))
    out: dict[str, list[int]] = {"after": [], "never": []}
    core = _engine(tiny_llama, windows, speculative)
    for rid, s in (("after", spec), ("never", never)):
        core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=24, structured=s))
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
    assert out["after"][: at + 2] == free[: at + 2]  # the thinking: free
    rest = tokenizer.decode(out["after"][at + 2 :])
    assert re.fullmatch("[a-z]{6}", rest), rest  # the answer: held to the grammar
    assert not re.fullmatch("[a-z]{6}", tokenizer.decode(free[at + 2 : len(out["after"])]))  # (it would not be)
    assert out["never"] and out["never"] == free[: len(out["never"])]  # (free to end at EOS: no ignore_eos here)


def test_a_grammar_that_begins_past_a_header(tiny_llama: LoadedModel) -> None:
    """With ``after_close``, the grammar waits past the header ``after`` opens until its close (harmony's final
    message, whose header may hold `` <|constrain|>json`` before ``<|message|>``): free until then, held after."""
    tokenizer = tiny_llama.tokenizer
    prompt = tokenizer.encode("Think first, then answer:")
    free = _free_greedy(tiny_llama, prompt, 24)
    # (The header: the free output's second token to its fifth, before the first end of sequence, its sixth.)
    assert not set(free[:5]) & set(tiny_llama.tokenizer.eos_token_ids)
    after, close = (free[1],), (free[4],)
    at = next(i for i in range(len(free)) if free[i] == after[0])
    end = next(i for i in range(at + 1, len(free)) if free[i] == close[0]) + 1
    spec = StructuredOutput("regex", "[a-z]{6}", "structured_outputs", after=after, after_close=close)
    core = _engine(tiny_llama)
    core.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=24, structured=spec))
    out: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            out += delta.new_token_ids
    assert out[:end] == free[:end]  # the header: free
    assert re.fullmatch("[a-z]{6}", tokenizer.decode(out[end:])), tokenizer.decode(out[end:])


def test_a_grammar_begins_past_the_header_that_closes_within_reach() -> None:
    """``after_close`` (harmony's ``<|channel|>final`` ... ``<|message|>``): the grammar begins past the first close
    within MAX_HEADER_TOKENS of an ``after``; while the header may still close it waits; an ``after`` whose header runs
    past the reach is passed over for the next."""
    from boundless.engine.structured_output import MAX_HEADER_TOKENS, grammar_start

    after, close = (7, 8), (9,)
    assert grammar_start([1, 7, 8, 9, 5], after) == 3  # (no close: right after)
    assert grammar_start([1, 7, 8, 9, 5], after, close) == 4
    assert grammar_start([1, 7, 8, 3, 4, 9, 5], after, close) == 6  # (a header with more in it: " <|constrain|>json")
    assert grammar_start([1, 7, 8, 3, 4], after, close) is None  # (not closed yet)
    far = [7, 8] + [3] * MAX_HEADER_TOKENS + [9]
    assert grammar_start(far, after, close) == len(far)  # (just within reach)
    too_far = [7, 8] + [3] * (MAX_HEADER_TOKENS + 1) + [9, 7, 8, 9, 5]
    assert grammar_start(too_far, after, close) == len(too_far) - 1  # (the first header passed over)
    assert grammar_start(too_far[: MAX_HEADER_TOKENS + 3], after, close) is None  # (out of reach, no other yet)
    assert grammar_start([3, 9, 7, 8], after, close) is None  # (a close before the after does not count)


def test_a_grammar_after_given_tokens_is_replayed_from_them(tiny_llama: LoadedModel) -> None:
    """A decode engine takes over a request whose thinking ended on the prefill engine: its matcher starts at the
    tokens after the end of thinking, not at the output's first."""
    tokenizer = tiny_llama.tokenizer
    prompt = tokenizer.encode("A color:")
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    started = tokenizer.encode("hmm, green</think>", add_special_tokens=False) + tokenizer.encode('{"color": "gr')
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), after=end)
    _assert_only_greens_rest_comes_next(tiny_llama, prompt, started, spec)


def test_grammars_past_the_cache_are_not_kept_by_the_compiler(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new schema per request (tools that differ per call) must not grow the memory the engine holds: the engine keeps
    # the last MAX_GRAMMARS grammars, and xgrammar's compiler, whose cache is unbounded by default, none besides.
    monkeypatch.setattr(structured_output_module, "MAX_GRAMMARS", 2)
    core = _engine(tiny_llama)

    def run_schemas(first: int, count: int) -> None:
        requests = {}
        for i in range(first, first + count):
            schema = {"type": "object", "properties": {f"key{i}": {"type": "integer"}}, "required": [f"key{i}"]}
            params = SamplingParams(temperature=0.0, max_tokens=4, structured=StructuredOutput.json_schema(schema))
            requests[f"s{i}"] = (tiny_llama.tokenizer.encode(f"Item {i}:"), params)
        _run(core, requests)

    assert core.grammars is not None
    run_schemas(0, 3)
    held = core.grammars._compiler.get_cache_size_bytes()
    run_schemas(3, 6)
    # (The grammars of the requests that ended at the last step are in use until the next step lets their matchers go.)
    _run(core, {"free": (tiny_llama.tokenizer.encode("Then:"), SamplingParams(temperature=0.0, max_tokens=2))})
    assert len(core.grammars._compiled) == 2
    assert core.grammars._compiler.get_cache_size_bytes() == held


def test_a_step_with_nothing_to_run_keeps_the_departures_for_the_next(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished request's sampling state (its grammar's matcher, its seeded generator) is dropped by the next step
    that runs. A step decided with nothing to run (here a request waiting for its grammar; on a decode engine one
    waiting for its first token) passes the departures on: it dropped them, and that state was kept for good."""
    core = _engine(tiny_llama)
    assert core.grammars is not None
    sampler = core.executor.runner.sampler
    encode = tiny_llama.tokenizer.encode
    done = SamplingParams(temperature=1.0, seed=7, max_tokens=3, structured=StructuredOutput.json_schema(SCHEMA))
    _run(core, {"done": (encode("A color:"), done)})
    assert "done" in sampler._matchers and "done" in sampler._generators  # (until a step after its end)
    gate = threading.Event()
    compile_grammar = core.grammars._compile

    def held_compile(spec: StructuredOutput) -> object:
        assert gate.wait(30)
        return compile_grammar(spec)

    monkeypatch.setattr(core.grammars, "_compile", held_compile)
    held = SamplingParams(temperature=0.0, max_tokens=3, structured=StructuredOutput("json_object"))
    core.add_request("held", encode("An object:"), held)
    assert core.step() == []  # its grammar is not ready: nothing ran (the step waited for it, bounded)
    gate.set()
    while core.has_unfinished():
        core.step()
    assert "done" not in sampler._matchers and "done" not in sampler._generators
