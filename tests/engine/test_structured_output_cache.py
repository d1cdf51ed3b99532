"""The compiled-grammar cache (``Grammars``) on real xgrammar compilations of real schemas: bounded by the bytes its
grammars hold, least recently used let go first, and never a grammar a live matcher (a running request) holds."""

from __future__ import annotations

import gc

import pytest

from boundless.config import CacheConfig, EngineConfig, ModelConfig
from boundless.engine import structured_output as structured_output_module
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.structured_output import Grammars, StructuredOutput
from boundless.model.loader import LoadedModel

pytest.importorskip("xgrammar")


def _schema(i: int) -> StructuredOutput:
    """A schema of its own per ``i`` (as tools that differ per call give): a grammar of full size each."""
    schema = {
        "type": "object",
        "properties": {f"key{i}": {"type": "integer"}, "name": {"type": "string"}},
        "required": [f"key{i}", "name"],
    }
    return StructuredOutput.json_schema(schema)


def _compile(grammars: Grammars, spec: StructuredOutput) -> None:
    grammars.prepare(spec)
    grammars._future(spec).result()  # (its bytes are counted before the future's result is handed out)


def _kept_bytes(grammars: Grammars) -> int:
    """What the kept grammars hold, as xgrammar measures them (and their specs' text), read afresh."""
    return sum(f.result().memory_size_bytes + len(s.definition or "") for s, f in grammars._compiled.items())


@pytest.fixture
def one_size(tiny_llama: LoadedModel) -> int:
    """The bytes one schema's grammar holds for the tiny model's vocabulary."""
    grammars = Grammars(tiny_llama.tokenizer, tiny_llama.arch.vocab_size)
    _compile(grammars, _schema(0))
    size = grammars.held_bytes
    grammars.close()
    assert size > 10_000  # (the token masks: a real grammar, not a stand-in)
    return size


def test_the_kept_grammars_stay_within_the_byte_budget(tiny_llama: LoadedModel, one_size: int) -> None:
    # Room for three schemas' grammars by bytes, for a hundred by count: the count-only cache kept all ten.
    budget = 3 * one_size + one_size // 2
    grammars = Grammars(tiny_llama.tokenizer, tiny_llama.arch.vocab_size, max_bytes=budget, max_grammars=100)
    for i in range(10):
        _compile(grammars, _schema(i))
        assert grammars.held_bytes == _kept_bytes(grammars) <= budget
    assert list(grammars._compiled) == [_schema(i) for i in (7, 8, 9)]
    # The least recently used goes first: one looked up again outlives those compiled after it.
    grammars.prepare(_schema(7))
    _compile(grammars, _schema(10))
    assert list(grammars._compiled) == [_schema(i) for i in (9, 7, 10)]
    assert grammars.held_bytes == _kept_bytes(grammars) <= budget
    grammars.close()


def test_a_grammar_a_matcher_holds_is_kept_past_the_budget_until_it_is_dropped(
    tiny_llama: LoadedModel, one_size: int
) -> None:
    # A running request's grammar: the sampler holds its matcher until the request ends, and remakes the matcher from
    # the cache (its outputs changed under it, as after a window's discarded tokens): had the grammar gone, the
    # engine's step would compile it again on the spot. The count-only cache let it go after `max_grammars` others.
    budget = 2 * one_size + one_size // 2
    grammars = Grammars(tiny_llama.tokenizer, tiny_llama.arch.vocab_size, max_bytes=budget, max_grammars=2)
    running = _schema(0)
    matcher = grammars.matcher(running)
    compiled = grammars._compiled[running]
    tokens = tiny_llama.tokenizer.encode('{"key0": 12', add_special_tokens=False)
    matcher.replay(tokens[:3])
    for i in range(1, 8):
        _compile(grammars, _schema(i))
        assert running in grammars._compiled and grammars._compiled[running] is compiled  # (not compiled again)
        assert grammars.held_bytes == _kept_bytes(grammars) <= budget
    assert grammars.in_use(running)
    matcher.replay(tokens[3:])  # (the matcher itself goes on where it was)
    again = grammars.matcher(running)  # a remade one reuses the compilation
    assert grammars._compiled[running] is compiled
    again.replay(tokens)
    # Dropped (the request ended), the grammar is let go like any other.
    del matcher, again
    gc.collect()
    assert not grammars.in_use(running)
    assert list(grammars._compiled) == [_schema(7), running]  # (the remade matcher used it last)
    _compile(grammars, _schema(8))
    _compile(grammars, _schema(9))
    assert list(grammars._compiled) == [_schema(8), _schema(9)]
    grammars.close()


def test_grammars_in_use_may_hold_more_than_the_budget_and_are_let_go_when_done(
    tiny_llama: LoadedModel, one_size: int
) -> None:
    # Three running requests' grammars where the budget holds one: none is let go (each is in memory anyway, its
    # matcher holding it); once they end, the cache is back within its budget.
    budget = one_size + one_size // 2
    grammars = Grammars(tiny_llama.tokenizer, tiny_llama.arch.vocab_size, max_bytes=budget)
    matchers = [grammars.matcher(_schema(i)) for i in range(3)]
    assert list(grammars._compiled) == [_schema(i) for i in range(3)]
    assert grammars.held_bytes > budget
    matchers.clear()  # (the requests end: their matchers' finalizers let the grammars go at once)
    gc.collect()
    assert len(grammars._compiled) == 1 and not any(grammars.in_use(_schema(i)) for i in range(3))
    assert grammars.held_bytes == _kept_bytes(grammars) <= budget
    _compile(grammars, _schema(3))
    assert list(grammars._compiled) == [_schema(3)]
    grammars.close()


def test_a_failed_compilation_counts_and_leaves_no_user(tiny_llama: LoadedModel) -> None:
    # A grammar xgrammar builds but cannot compile (a negative minLength): its error is kept for the requests after
    # it, its matcher raises and leaves no user behind that would pin it.
    grammars = Grammars(tiny_llama.tokenizer, tiny_llama.arch.vocab_size, max_bytes=1, max_grammars=4)
    bad = StructuredOutput.json_schema({"type": "string", "minLength": -1})
    with pytest.raises(Exception, match="cannot be used"):
        grammars.matcher(bad)
    assert grammars.error(bad) is not None and not grammars.in_use(bad)
    _compile(grammars, _schema(0))  # over a byte's budget: everything not in use goes
    assert list(grammars._compiled) == [_schema(0)] or not grammars._compiled
    grammars.close()


def test_an_engine_keeps_a_running_requests_grammar_while_others_pass(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the engine: a long request's grammar outlives the grammars of the short requests that pass while it runs,
    in a cache that holds two grammars."""
    monkeypatch.setattr(structured_output_module, "MAX_GRAMMARS", 2)
    cfg = EngineConfig(model=ModelConfig(max_model_len=512), cache=CacheConfig(num_kv_blocks=256))
    core = EngineCore.from_model(tiny_llama, cfg)
    assert core.grammars is not None
    tokenizer = tiny_llama.tokenizer
    long_spec = StructuredOutput("regex", "[ab]{400}")  # max_tokens ends it first
    params = SamplingParams(temperature=0.0, max_tokens=120, structured=long_spec)
    core.add_request("long", tokenizer.encode("Go:"), params)
    while not core.grammars.in_use(long_spec):
        core.step()
    compiled = core.grammars._compiled[long_spec]
    text, done, short = "", False, 0
    while not done:
        if short < 6 and not any(r.startswith("short") for r in core.scheduler.requests):  # one at a time
            params = SamplingParams(temperature=0.0, max_tokens=2, structured=_schema(short))
            core.add_request(f"short{short}", tokenizer.encode(f"Item {short}:"), params)
            short += 1
        for delta in core.step():
            if delta.request_id == "long":
                text += delta.new_text
                done = delta.finished
        if not done:
            assert core.grammars._compiled.get(long_spec) is compiled
        assert len(core.grammars._compiled) <= 3  # (the running request's, and two)
    assert short == 6 and text and set(text) <= {"a", "b"}
    # The sampler lets a finished request's matcher go at the next step that runs; then its grammar may go.
    core.add_request("after", tokenizer.encode("Then:"), SamplingParams(temperature=0.0, max_tokens=2))
    while core.has_unfinished():
        core.step()
    assert not core.grammars.in_use(long_spec)
