"""The offline API end to end: sampling options, stopping rules, logprobs, n, chat, prefix caching."""

from __future__ import annotations

import dataclasses
import enum
import gc
from typing import Any

import pytest
import torch

from boundless import LLM, SamplingParams
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import InvalidSamplingParams, truncated_prompt
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model


@pytest.fixture
def llm(smollm2: LoadedModel) -> LLM:
    return LLM.from_config(_config(smollm2), smollm2)


def _config(loaded: LoadedModel, **kwargs):
    from boundless.llm import engine_config

    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("kv_cache_gb", 0.25)
    return engine_config(loaded.name, **kwargs)


def test_generate_accepts_text_and_token_ids(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    by_text = llm.generate("The capital of France is", params)[0]
    ids = llm.tokenizer.encode("The capital of France is")
    by_ids = llm.generate(ids, params)[0]
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    out = by_text.outputs[0]
    assert out.finish_reason in ("length", "stop")
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert len(out.token_ids) <= 8


def test_generate_decodes_each_output_once_at_its_end(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM.generate`` reads its outputs when the batch is done (``RequestOutputKind.FINAL_ONLY``, as vLLM's LLM asks):
    each text is decoded at its end, two windows a request, not two a token; and it is the text of its tokens."""
    windows = []
    batch_decode = llm.tokenizer.decode_batch

    def counted(seqs, skip_special_tokens=True):
        windows.extend(seqs)
        return batch_decode(seqs, skip_special_tokens)

    monkeypatch.setattr(llm.engine.tokenizer, "decode_batch", counted)  # (the session's tokenizer: put back after)
    outs = llm.generate(["The sea is", "Once upon a time"], SamplingParams(temperature=0.0, max_tokens=24))
    assert all(len(o.outputs[0].token_ids) > 8 for o in outs)
    assert len(windows) <= 2 * 2 + 2  # (a text that ends inside a character is decoded again a token shorter)
    for o in outs:
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)


def test_vllm_prompt_dicts(llm: LLM) -> None:
    """vLLM's TextPrompt and TokensPrompt give what a text and token ids give; a prompt of another shape is a clear
    error and leaves nothing of its batch queued."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    ids = llm.tokenizer.encode("The capital of France is")
    outs = llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}, ids], params)
    assert outs[0].prompt_token_ids == ids and len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    # A TokensPrompt may carry its text (vLLM's): the ids are read, the text is the output's prompt.
    both = llm.generate({"prompt_token_ids": ids, "prompt": "The capital of France is"}, params)[0]
    assert both.prompt == "The capital of France is" and both.outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["Hi", {"prompt": "x", "images": []}], params)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["Hi", {"cache_salt": "a"}], params)
    with pytest.raises(ValueError, match="read text only"):
        llm.generate(["Hi", {"prompt": "x", "multi_modal_data": {"image": "x.png"}}], params)
    with pytest.raises(TypeError, match="a prompt is a string"):
        llm.generate(["Hi", [1, "2"]], params)
    with pytest.raises(TypeError, match="a prompt is a string"):  # (a bool is an int to Python, not a token id)
        llm.generate(["Hi", [ids[0], True]], params)
    # An int of a subclass is a token id (an IntEnum's, say), as before the check took one pass.
    first = enum.IntEnum("First", {"TOKEN": ids[0]}).TOKEN
    assert llm.generate([[first, *ids[1:]]], params)[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert not llm.engine.has_unfinished()


def test_max_tokens_and_ignore_eos(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_seed_makes_sampling_reproducible_whatever_the_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["Tell me a story", "Once upon a time", "Why?"], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        "Once upon a time", SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate("Water is", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    top1 = llm.generate("Water is", SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=10, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_top_p_keeps_only_the_nucleus(llm: LLM) -> None:
    # With a tiny top_p only the most likely token survives, so sampling is greedy.
    greedy = llm.generate("Water is", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    nucleus = llm.generate("Water is", SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == nucleus[0].outputs[0].token_ids


def test_n_returns_distinct_samples(llm: LLM) -> None:
    res = llm.generate("My favourite colour is", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8))[0]
    assert [o.index for o in res.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in res.outputs}) > 1


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    free = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = free.outputs[0].text
    stop = text.strip()[2:4] if len(text.strip()) >= 4 else text.strip()[:1]
    res = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True))
    out = res[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], include_stop_str_in_output=True, ignore_eos=True),
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_many_stop_strings_cut_the_text_where_the_one_found_first_does(llm: LLM) -> None:
    """20,000 stop strings (found by their lengths, not a search each: engine/stop_strings.py) on samples of one
    request: each sample's text is cut where the one of them it holds first begins, as with that string alone."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    text = llm.generate("Count: 1, 2, 3,", params)[0].outputs[0].text
    stop = text.strip()[2:5]
    decoys = [f"zq{i}#" for i in range(20_000)]
    many = dataclasses.replace(params, stop=[*decoys[:7000], stop, *decoys[7000:]], n=2)
    for out in llm.generate("Count: 1, 2, 3,", many)[0].outputs:
        assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[: text.index(stop)]


def test_stop_strings_count_from_the_token_after_min_tokens(llm: LLM) -> None:
    """vLLM's rule: a stop string ending in the text of the first ``min_tokens`` tokens stops nothing; the first one
    ending after it does (it may begin before)."""
    prompt, stop = "The capital of France is", " "
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    first = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True))
    assert first[0].outputs[0].text == free.text[: free.text.index(stop)] and len(first[0].outputs[0].token_ids) < 5
    held = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], min_tokens=5, ignore_eos=True)
    )[0].outputs[0]
    head = llm.tokenizer.decode(free.token_ids[:5])  # the first five tokens' text
    end = free.text.index(stop, len(head) - len(stop) + 1)
    assert held.finish_reason == "stop" and len(held.token_ids) > 5
    assert held.text == free.text[:end]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    free = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    first, second = free.outputs[0].token_ids[:2]
    stopped = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[second]))
    out = stopped[0].outputs[0]
    assert out.token_ids == [first, second] and out.finish_reason == "stop" and out.stop_reason == second
    # min_tokens forbids stop tokens until enough tokens came out.
    held = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, stop_token_ids=[first])
    )[0].outputs[0]
    assert first not in held.token_ids[:4] and len(held.token_ids) >= 4


@pytest.mark.parametrize("stop", [(), ("<never>",)], ids=["decoded-at-its-end", "decoded-a-token-at-a-time"])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm: LLM, stop: tuple[str, ...]) -> None:
    """vLLM's rule: the token that stopped the output (one of stop_token_ids, or EOS) is among its token ids, and its
    text is in the output's text only with include_stop_str_in_output. (A stop string decodes a token at a time.)"""
    free = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    first, second = free.outputs[0].token_ids[:2]
    assert llm.tokenizer.decode([first, second]) != llm.tokenizer.decode([first])  # (the stop token has text)
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0, max_tokens=10, stop=stop, stop_token_ids=[second], include_stop_str_in_output=include
        )
        out = llm.generate("Count: 1, 2, 3,", params)[0].outputs[0]
        assert out.token_ids == [first, second] and out.stop_reason == second
        assert out.text == llm.tokenizer.decode([first, second] if include else [first])
    eos = [{"role": "user", "content": "Say just: ok"}]
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0, max_tokens=40, stop=stop, skip_special_tokens=False, include_stop_str_in_output=include
        )
        out = llm.chat(eos, params)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert out.text == llm.tokenizer.decode(out.token_ids[: None if include else -1], skip_special_tokens=False)
        assert out.text.endswith("<|im_end|>") == include


def test_logprobs_are_the_model_distribution_in_vllms_shape(llm: LLM, smollm2: LoadedModel) -> None:
    """Each generated token's logprobs (vLLM's ``list[dict[int, Logprob]]``): the token itself first, then its top
    alternatives by rank, each with its text alone; the values the log-softmax of the model's logits."""
    prompt = llm.tokenizer.encode("The sky is")
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    first = out.logprobs[0]
    token = out.token_ids[0]
    assert next(iter(first)) == token and first[token].rank == 1 and len(first) == 5  # (greedy: it is the top one)
    assert [e.rank for e in first.values()] == [1, 2, 3, 4, 5]
    assert all(e.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False) for t, e in first.items())
    # The first token's logprobs are the log-softmax of the prefill step's logits.
    ref = _dense_logprobs(smollm2, prompt)
    top = torch.topk(ref, 5)
    assert list(first) == top.indices.tolist()
    assert max(abs(e.logprob - b) for e, b in zip(first.values(), top.values.tolist(), strict=True)) < 1e-4
    chosen = [position[t].logprob for position, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen))
    # A sampled token outside the top alternatives comes first with its own rank; without text, no decoded_token.
    sampled = SamplingParams(temperature=2.0, seed=3, max_tokens=8, logprobs=1, ignore_eos=True, detokenize=False)
    out = llm.generate(prompt, sampled)[0].outputs[0]
    assert out.logprobs is not None and out.text == ""
    for position, t in zip(out.logprobs, out.token_ids, strict=True):
        assert next(iter(position)) == t and all(e.decoded_token is None for e in position.values())
        assert len(position) == (1 if position[t].rank == 1 else 2)
    assert any(position[t].rank > 1 for position, t in zip(out.logprobs, out.token_ids, strict=True))


def test_prompt_logprobs_in_vllms_shape(llm: LLM) -> None:
    """``RequestOutput.prompt_logprobs``: None for the first prompt token, then each token's entry holding it with its
    rank and text, and its top alternatives; the same as a generated token's where the text is the same."""
    ids = llm.tokenizer.encode("The sky is blue and the grass is")
    res = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, logprobs=2))[0]
    scored = res.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    for t, position in zip(ids[1:], scored[1:], strict=True):
        assert position is not None and next(iter(position)) == t and len(position) <= 3
        assert position[t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
        assert sorted(e.rank for k, e in position.items() if k != t or e.rank <= 2)[:2] == [1, 2]
    # The next prompt's last token is this one's first generated token: scored alike.
    longer = llm.generate(ids + res.outputs[0].token_ids, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert longer.prompt_logprobs is not None and res.outputs[0].logprobs is not None
    last = longer.prompt_logprobs[-1]
    assert last is not None and res.outputs[0].logprobs[0].keys() == last.keys()
    for a, b in zip(res.outputs[0].logprobs[0].values(), last.values(), strict=True):
        assert (
            a.rank == b.rank and a.decoded_token == b.decoded_token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        )


def test_max_logprobs_bounds_the_alternatives_a_request_asks_for(llm: LLM, smollm2: LoadedModel) -> None:
    """vLLM's ``max_logprobs``: 20 by default, past it a request is refused naming it (and the engine serves on);
    raised, or -1 for the whole vocabulary, a request gets as many alternatives as it asks for."""
    ids = llm.tokenizer.encode("The sky is")
    for asked in ({"logprobs": 21}, {"prompt_logprobs": 21}):
        with pytest.raises(InvalidRequestError, match="more than the 20 this engine gives"):
            llm.generate(ids, SamplingParams(max_tokens=1, **asked))
    assert llm.generate(ids, SamplingParams(max_tokens=1, logprobs=20))[0].outputs[0].logprobs is not None
    with pytest.raises(ValueError, match="--max-logprobs: must be -1"):
        _config(smollm2, max_logprobs=-2)
    wide = LLM.from_config(_config(smollm2, max_logprobs=-1), smollm2)
    res = wide.generate(ids, SamplingParams(temperature=0.0, max_tokens=2, logprobs=64, prompt_logprobs=40))[0]
    assert res.outputs[0].logprobs is not None and [len(p) for p in res.outputs[0].logprobs] == [64, 64]
    assert res.prompt_logprobs is not None
    assert all(p is not None and len(p) in (40, 41) for p in res.prompt_logprobs[1:])
    ranked = list(res.outputs[0].logprobs[0].values())
    assert [e.rank for e in ranked] == list(range(1, 65))
    # -1 is the whole vocabulary, and no more: past it a top-k failed the step, every request of it.
    vocab = smollm2.arch.vocab_size
    with pytest.raises(InvalidRequestError, match=f"more than the {vocab} this engine gives"):
        wide.generate(ids, SamplingParams(max_tokens=1, logprobs=vocab + 1))


def test_vllms_names_and_fields(llm: LLM) -> None:
    """What vLLM's code calls: ``sampling_params=``, ``get_tokenizer()``, ``RequestOutput.finished``,
    ``CompletionOutput.finished()``, and a chat output's ``prompt`` (its conversation's rendered text)."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    out = llm.generate("Hello", sampling_params=params)[0]
    assert out.finished and out.outputs[0].finished() and out.prompt == "Hello"
    assert llm.get_tokenizer() is llm.tokenizer
    messages = [{"role": "user", "content": "Say hi"}]
    chat = llm.chat(messages, sampling_params=params)[0]
    assert chat.prompt == llm.tokenizer.apply_chat_template(messages)
    assert chat.prompt_token_ids == llm.tokenizer.encode(chat.prompt, add_special_tokens=False)
    assert chat.outputs[0].token_ids == llm.generate(chat.prompt_token_ids, params)[0].outputs[0].token_ids


def test_an_output_stops_where_the_context_is_full(smollm2: LoadedModel) -> None:
    """As vLLM's LLM: ``max_tokens`` past what the context holds after the prompt stops the output there (``length``),
    ``min_tokens`` too; a prompt that fills the context gets its one token; a prompt past it is refused, and the rest of
    its batch with it."""
    llm = LLM.from_config(_config(smollm2, max_model_len=64), smollm2)
    near = list(range(1000, 1058))  # 58 tokens: room for 6
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=20, ignore_eos=True)
    out = llm.generate([near, near[:10]], params)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"
    assert len(out[1].outputs[0].token_ids) == 32  # (the other prompt's params are its own)
    assert len(llm.generate(near, SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0].token_ids) == 6
    full = llm.generate(list(range(1000, 1064)), params)[0].outputs[0]
    assert len(full.token_ids) == 1 and full.finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="context length") as e:
        llm.generate([near[:10], list(range(1000, 1065))], params)
    assert e.value.param == "prompt" and not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_scheduler_steps": 4},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}},
    ],
    ids=["single-steps", "windows", "ngram-drafts"],
)
def test_a_prompt_that_fills_the_context_gets_one_token(smollm2: LoadedModel, options: dict) -> None:
    """The one token sampled at the end of a prompt that fills the context (never read back: no room for its KV), in a
    batch with prompts that have room, whatever the engine's steps: single, windows of passes, or drafts verified."""
    llm = LLM.from_config(_config(smollm2, max_model_len=64, num_kv_blocks=16, block_size=16, **options), smollm2)
    repeating = [1000 + i % 5 for i in range(64)]  # (a pattern the n-gram drafter proposes from)
    outs = llm.generate([repeating, repeating[:63], repeating[:40]], SamplingParams(temperature=0.0, max_tokens=30))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1, 24]
    assert all(o.outputs[0].finish_reason == "length" for o in outs[:2])
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks  # (nothing held after the batch)


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm: LLM) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens are read (-1: as many as the context holds)."""
    ids = llm.tokenizer.encode("one two three four five six seven eight nine ten")
    params = SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=4)
    out = llm.generate(ids, params)[0]
    assert out.prompt_token_ids == ids[-4:]
    assert (
        out.outputs[0].token_ids
        == llm.generate(ids[-4:], dataclasses.replace(params, truncate_prompt_tokens=None))[0].outputs[0].token_ids
    )
    assert truncated_prompt(list(range(10)), -1, 4) == [6, 7, 8, 9]
    whole = llm.generate([7] * 1030, SamplingParams(max_tokens=8, truncate_prompt_tokens=-1))[0]
    assert len(whole.prompt_token_ids) == 1024 and len(whole.outputs[0].token_ids) == 1  # (the context's last token)
    for bad in (0, -2, True):
        with pytest.raises(InvalidSamplingParams, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(InvalidSamplingParams, match="truncate_prompt_tokens"):
        llm.generate(ids, SamplingParams(truncate_prompt_tokens=2000))


def test_a_prompt_dicts_cache_salt_keeps_its_prefix_apart(llm: LLM) -> None:
    """vLLM's prompt dicts may carry ``cache_salt``: a salted prompt shares no cached KV with the prompt unsalted."""
    ids = llm.tokenizer.encode("You are a helpful assistant. " * 8)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(ids, params)
    assert llm.generate(ids, params)[0].num_cached_tokens > 0
    salted = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, params)[0]
    assert salted.num_cached_tokens == 0
    assert llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, params)[0].num_cached_tokens > 0


def test_sampling_params_take_none_for_empty_and_refuse_other_types() -> None:
    """vLLM's optional list and map fields take None; an int field refuses a bool or a float (``logprobs=2.5`` had
    passed, then failed the whole batch's step)."""
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None, bad_words=None)
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias == () and p.bad_words == ()
    for field, bad in [
        ("logprobs", 2.5), ("logprobs", True), ("n", True), ("top_k", True), ("min_tokens", True),
        ("min_tokens", 1.0), ("temperature", "1"), ("top_p", True),
    ]:  # fmt: skip
        with pytest.raises(InvalidSamplingParams) as e:
            SamplingParams(**{field: bad})
        assert e.value.param == field


def test_vllms_engine_arguments() -> None:
    """vLLM's ``LLM(...)`` arguments: those that mean something here are read, those that ask for nothing more are
    taken, and those that ask for what this engine does not do are refused with the reason."""
    from boundless.config import ConfigError, vllm_engine_args
    from boundless.llm import engine_config

    args = vllm_engine_args(
        "m", {"swap_space": 2, "trust_remote_code": True, "tensor_parallel_size": 1, "disable_log_stats": True}
    )
    assert args == {"swap_space_gb": 2, "tensor_parallel_size": 1}
    assert engine_config("m", **args).cache.swap_space_gb == 2
    assert engine_config("m", **vllm_engine_args("m", {"tensor_parallel_size": 3})).model.tensor_parallel_size == 3
    assert vllm_engine_args("m", {"tokenizer": "m", "enable_chunked_prefill": True}) == {}
    for bad in ({"tokenizer": "other"}, {"enable_chunked_prefill": False}, {"download_dir": "/x"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            vllm_engine_args("m", bad)
    # quantization is taken (fp8 applied at load); another method is refused by the model's config.
    assert engine_config("m", **vllm_engine_args("m", {"quantization": "fp8"})).model.quantization == "fp8"
    with pytest.raises(ConfigError, match="quantization: 'awq' is not applied here"):
        engine_config("m", **vllm_engine_args("m", {"quantization": "awq"}))


def _dense_logprobs(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    llm = LLM.from_config(_config(loaded, enable_prefix_caching=False), loaded)
    core = llm.engine
    core.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    step = core.executor.runner.forward(core.scheduler.schedule())
    return torch.log_softmax(step.logits[0], dim=-1)


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    res = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6))[0]
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert res.prompt_token_ids == expected
    assert llm.tokenizer.decode(expected, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_chat_takes_the_servers_message_shapes(llm: LLM) -> None:
    """Content as text parts, an assistant turn of tool calls alone (content None, or left out), ``developer``: the
    prompt the plain shapes give (each failed in the template: a list concatenated to a string, an undefined content);
    a part the server refuses is refused here too."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"},  # (text parts are joined by newlines, as vLLM joins them)
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    shaped = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    expected = llm.chat(plain, params)[0].prompt_token_ids
    assert llm.chat(shaped, params)[0].prompt_token_ids == expected
    no_content = [m if m["role"] != "assistant" else {"role": "assistant", "tool_calls": [call]} for m in shaped]
    assert llm.chat(no_content, params)[0].prompt_token_ids == expected
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    # Unlike the server, any role and any other key pass as given (a template may read them: Llama-3.1's ipython).
    other = llm.chat([*plain, {"role": "ipython", "content": "7", "weight": 0}], params)[0].prompt_token_ids
    assert other[: len(expected) - 3] == expected[: len(expected) - 3] and len(other) > len(expected)


def test_prefix_cache_computes_only_new_tokens(smollm2: LoadedModel) -> None:
    llm = LLM.from_config(_config(smollm2, block_size=16), smollm2)
    core = llm.engine
    shared = llm.tokenizer.encode("You are a helpful assistant. " * 12)
    assert len(shared) >= 64
    llm.generate(shared + [100, 101], SamplingParams(temperature=0.0, max_tokens=2))
    before = core.counters.computed_tokens
    res = llm.generate(shared + [200, 201, 202], SamplingParams(temperature=0.0, max_tokens=1))[0]
    computed = core.counters.computed_tokens - before
    cached = (len(shared) // 16) * 16
    assert res.num_cached_tokens == cached
    assert computed == len(shared) + 3 - cached  # only the uncached tail ran through the model


def test_evicted_blocks_are_reused(tiny_llama: LoadedModel) -> None:
    llm = LLM.from_config(_config(tiny_llama, num_kv_blocks=12, block_size=4, max_model_len=48), tiny_llama)
    pool = llm.engine.kv.pool
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        llm.generate(torch.randint(3, 300, (30,), generator=g).tolist(), params)
    assert pool.stats.evictions > 0  # old prompts' cached blocks made room for new ones
    assert pool.num_free == pool.num_blocks  # and nothing leaked


def test_bad_requests_raise_clear_errors(llm: LLM) -> None:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([1] * 1025, SamplingParams(max_tokens=10))
    assert "context length" in str(e.value)
    with pytest.raises(InvalidRequestError):
        llm.generate([10**7], SamplingParams(max_tokens=1))
    # The engine still serves after rejecting requests.
    assert llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids


def test_out_of_vocabulary_stop_token_id_is_refused(llm: LLM) -> None:
    # With min_tokens the sampler bans the stop ids by indexing the logits; an id past the vocabulary must be
    # refused when the request is added, not fail the step of every request in the batch.
    vocab = llm.engine.identity.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("Hi", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab]))
    assert e.value.param == "stop_token_ids" and str(vocab) in str(e.value)
    assert not llm.engine.has_unfinished()
    out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """A random model whose vocabulary (448 rows) is padded past its tokenizer's 384 tokens, as Qwen's is."""
    root = write_random_model(tmp_path_factory.mktemp("padded") / "m", TinySpec(vocab_size=448))
    loaded = load_model(str(root))
    assert (loaded.arch.vocab_size, loaded.tokenizer.vocab_size) == (448, 384)
    return LLM.from_config(_config(loaded, kv_cache_gb=0.02), loaded)


def test_allowed_token_ids_past_the_tokenizer_are_refused(padded: LLM) -> None:
    """An id in [tokenizer size, model vocabulary) has a row of logits but no text: refused as vLLM (and the server)
    refuse it, not sampled."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with pytest.raises(InvalidRequestError) as e:
        padded.generate([5, 6, 7], dataclasses.replace(params, allowed_token_ids=[7, 400]))
    assert e.value.param == "allowed_token_ids" and "400" in str(e.value) and "384" in str(e.value)
    assert not padded.engine.has_unfinished()
    out = padded.generate([5, 6, 7], dataclasses.replace(params, allowed_token_ids=[7, 383]))[0].outputs[0]
    assert set(out.token_ids) <= {7, 383} and len(out.token_ids) == 2


def test_a_refused_prompt_fails_the_batch_and_leaves_nothing_queued(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    frozen = gc.get_freeze_count()
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7], [8, 9], []], params)  # the empty prompt is refused after two were added
    assert not llm.engine.has_unfinished() and gc.get_freeze_count() == frozen
    # An interrupt while the batch's texts are encoded (after one request was added) leaves nothing queued either.
    encode = llm.tokenizer.encode
    calls = iter(range(2))

    def interrupted(text: str, *args, **kwargs):
        if next(calls):
            raise KeyboardInterrupt
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello", "Hi"], params)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished() and gc.get_freeze_count() == frozen
    out = llm.generate([[5, 6, 7]], params)[0]  # the next batch sees only its own results
    assert len(out.outputs[0].token_ids) == 4


def test_a_progress_bar_counts_the_batchs_samples(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, n=2)
    llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=True)
    assert "4/4" in capsys.readouterr().err  # (two prompts, two samples each)


def test_generate_keeps_the_heap_before_it_out_of_the_collectors_walks(llm: LLM) -> None:
    """The objects that exist when ``generate`` starts (the model, the engine) are frozen while it adds its requests
    and steps, and back in the collector's care after, also when it fails (its requests then leave the engine: the
    next call runs alone)."""
    before = gc.get_freeze_count()
    seen: list[int] = []
    added: list[int] = []
    step, add_request = llm.engine.step, llm.engine.add_request

    def counting_step():
        seen.append(gc.get_freeze_count())
        return step()

    def counting_add(*args, **kwargs):
        added.append(gc.get_freeze_count())
        return add_request(*args, **kwargs)

    llm.engine.step = counting_step  # type: ignore[method-assign]
    llm.engine.add_request = counting_add  # type: ignore[method-assign]
    try:
        llm.generate(["Hello", "Hi there"], SamplingParams(max_tokens=3, ignore_eos=True))
        assert seen and min(seen) > before + 1000
        assert len(added) == 2 and min(added) > before + 1000  # (a collection the intake sets off walks no more)
        assert gc.get_freeze_count() == before

        def failing_step():
            raise RuntimeError("step failed")

        llm.engine.step = failing_step  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            llm.generate("Hello", SamplingParams(max_tokens=3))
        assert gc.get_freeze_count() == before
        # A heap frozen already (a server's start-up, the caller's own) stays frozen after.
        llm.engine.step = step  # type: ignore[method-assign]
        gc.freeze()
        try:
            frozen = gc.get_freeze_count()
            llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True))
            assert gc.get_freeze_count() > frozen // 2  # (objects freed meanwhile leave the count)
        finally:
            gc.unfreeze()
    finally:
        del llm.engine.step, llm.engine.add_request


@pytest.mark.parametrize(
    ("call", "error", "said"),
    [
        (lambda llm, sp: llm.generate(b"hello", sp), TypeError, "prompts: a prompt or a list of them, not bytes"),
        (lambda llm, sp: llm.generate([b"hello"], sp), TypeError, "a prompt is a string, a list of token ids"),
        (lambda llm, sp: llm.generate(None, sp), TypeError, "prompts: a prompt or a list of them, not NoneType"),
        (lambda llm, sp: llm.generate(5, sp), TypeError, "prompts: a prompt or a list of them, not int"),
        (lambda llm, sp: llm.generate({"prompt": None}, sp), TypeError, "'prompt' is a text, not None"),
        (lambda llm, sp: llm.generate("a", {"max_tokens": 3}), TypeError, "sampling_params: a SamplingParams"),
        (lambda llm, sp: llm.generate(["a"], [None]), TypeError, "sampling_params: a SamplingParams or a list"),
        (lambda llm, sp: llm.generate("a", "x"), TypeError, "sampling_params: a SamplingParams or a list"),
        (lambda llm, sp: llm.generate("a", sp, lora_request="ab"), TypeError, "lora_request: a LoRARequest"),
        (lambda llm, sp: llm.chat("hello", sp), TypeError, "messages: a conversation"),
        (lambda llm, sp: llm.chat(["hello"], sp), TypeError, "messages: conversation 0 is not a list"),
        (lambda llm, sp: llm.chat([{"content": "hi"}], sp), ValueError, r"messages\[0\]\[0\]: a message needs a role"),
        (lambda llm, sp: llm.chat([{"role": "user", "content": 5}], sp), TypeError, "content is a string or a list"),
        (lambda llm, sp: llm.chat([{"role": "user", "content": "hi"}], sp, tools="x"), TypeError, "tools: a list"),
        (lambda llm, sp: llm.chat([{"role": "user", "content": "hi"}], sp, tools=[{"foo": 1}]), TypeError, "tools"),
    ],
)
def test_arguments_of_the_wrong_shape_are_refused_by_name_and_the_llm_serves_on(
    llm: LLM, call: Any, error: type[Exception], said: str
) -> None:
    """vLLM's LLM's arguments in shapes it does not take: an error naming the argument (bytes were read as token
    ids, a string as a list of LoRA requests; the rest failed deep inside, with no argument named)."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(error, match=said):
        call(llm, params)
    assert llm.generate("Hi", params)[0].outputs[0].token_ids
