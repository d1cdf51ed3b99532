"""``SamplingParams.detokenize``: a request that asks for no text gets the tokens and finish of one that does, and
no decoding is done for it. ``SamplingParams.output_kind``: a request that takes its text at the end gets the text of
one that takes it token by token, whole in its last delta, decoded once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.detokenizer import IncrementalDetokenizer, add_runs, add_tokens, flush
from boundless.engine.sampling_params import InvalidSamplingParams, RequestOutputKind, SamplingParams
from boundless.model.loader import LoadedModel
from boundless.model.random_model import write_byte_fallback_tokenizer
from boundless.model.tokenizer import load_tokenizer

PROMPTS = [list(range(5, 5 + n)) for n in (7, 19, 33)]


class CountingDecoder:
    """The engine's tokenizer, counting the decodes asked of it."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.decodes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.tokenizer, name)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return self.tokenizer.decode(ids, skip_special_tokens)  # type: ignore[attr-defined]

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        self.decodes += len(seqs)
        return self.tokenizer.decode_batch(seqs, skip_special_tokens)  # type: ignore[attr-defined]


def _run(
    loaded: LoadedModel,
    k: int,
    detokenize: bool = True,
    kind: RequestOutputKind = RequestOutputKind.DELTA,
    stop: tuple[str, ...] = (),
    texts: list[tuple[str, bool]] | None = None,
) -> tuple[dict, dict, dict, int]:
    """Each prompt of ``PROMPTS`` run to its end: tokens, text and (finish reason, output tokens) by request, and the
    decodes asked of the tokenizer; ``texts`` gets each delta's text and whether it was the last."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(num_kv_blocks=64),
        scheduler=SchedulerConfig(policy="fcfs", num_scheduler_steps=k),
    )
    core = EngineCore.from_model(loaded, config)
    decoder = core.tokenizer = CountingDecoder(core.tokenizer)  # type: ignore[assignment]
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    ends: dict[str, tuple] = {}
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            temperature=0.0, max_tokens=9 + 7 * i, ignore_eos=True, detokenize=detokenize, output_kind=kind, stop=stop
        )
        core.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"], text[f"r{i}"] = [], ""
    while core.has_unfinished():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
            text[delta.request_id] += delta.new_text
            if texts is not None:
                texts.append((delta.new_text, delta.finished))
            if delta.finished:
                ends[delta.request_id] = (delta.finish_reason, delta.num_output_tokens)
    return tokens, text, ends, decoder.decodes


@pytest.mark.parametrize("k", [1, 8])
def test_no_text_asked_gives_the_same_tokens_and_finishes_without_decoding(tiny_llama: LoadedModel, k: int) -> None:
    tokens, text, ends, decodes = _run(tiny_llama, k, detokenize=True)
    bare_tokens, bare_text, bare_ends, bare_decodes = _run(tiny_llama, k, detokenize=False)
    assert bare_tokens == tokens and bare_ends == ends
    assert all(text.values()) and bare_text == {rid: "" for rid in tokens}
    assert decodes > 0 and bare_decodes == 0


def test_stop_strings_need_the_text() -> None:
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(stop=["\n"], detokenize=False)
    assert err.value.param == "stop"


def _streams(loaded: LoadedModel, seed: int) -> list[list[int]]:
    """Token streams whose text often ends a token inside a character: random ids (byte pieces among them) and text
    with accents, CJK and emoji."""
    rng = random.Random(seed)
    tok = loaded.tokenizer
    text = "héllo wörld, 世界 🙂🚀 naïve café — ünïcödé 日本語のテキスト " * 3
    return [
        tok.encode(text, add_special_tokens=False),
        [rng.randrange(loaded.arch.vocab_size) for _ in range(200)],
        [rng.randrange(loaded.arch.vocab_size) for _ in range(200)],
    ]


@pytest.mark.parametrize("model", ["tiny_llama", "smollm2"])
def test_a_run_of_tokens_gives_the_text_of_a_token_at_a_time(model: str, request: pytest.FixtureRequest) -> None:
    """``add_runs`` (a multi-step window's tokens in one decode) against ``add_tokens`` a token at a time, over runs of
    1 to 16 tokens: the same text after every run, also where a run ends inside a character (the tiny tokenizer's
    random ids do so about every other run); and fewer decodes."""
    loaded: LoadedModel = request.getfixturevalue(model)
    params = SamplingParams(max_tokens=1000)
    streams = _streams(loaded, seed=3)
    rng = random.Random(5)
    one = [IncrementalDetokenizer(CountingDecoder(loaded.tokenizer), [1, 2, 3], params) for _ in streams]
    runs = [IncrementalDetokenizer(CountingDecoder(loaded.tokenizer), [1, 2, 3], params) for _ in streams]
    cursors = [0] * len(streams)
    pending = 0
    while any(c < len(s) for c, s in zip(cursors, streams, strict=True)):
        chunk = [s[c : c + rng.randint(1, 16)] for c, s in zip(cursors, streams, strict=True)]
        for k in range(max(map(len, chunk))):
            live = [i for i, r in enumerate(chunk) if len(r) > k]
            add_tokens([one[i] for i in live], [chunk[i][k] for i in live])
        add_runs(runs, chunk)
        for a, b in zip(one, runs, strict=True):
            assert b.text == a.text
        cursors = [c + len(r) for c, r in zip(cursors, chunk, strict=True)]
        inside = [loaded.tokenizer.decode(s[:c]).endswith("\ufffd") for c, s in zip(cursors, streams, strict=True)]
        pending += sum(inside)
    assert all(d.text for d in runs) and pending > 0  # (runs ended inside a character)
    # (Byte-level BPE: one decode a run, also for random ids' bytes that are no UTF-8.)
    assert not loaded.tokenizer.byte_fallback
    assert sum(d.tokenizer.decodes for d in runs) < sum(d.tokenizer.decodes for d in one) / 2


@pytest.mark.parametrize("k", [1, 8])
def test_text_at_the_end_is_the_text_token_by_token_decoded_once(tiny_llama: LoadedModel, k: int) -> None:
    """``FINAL_ONLY`` without stop strings: the tokens, finishes and text of ``DELTA``, the text whole in the last delta
    (none before it), from one decode of each output (two windows a request, and a few more where an output ends
    inside a character) where ``DELTA`` decodes two windows a token."""
    tokens, text, ends, decodes = _run(tiny_llama, k)
    texts: list[tuple[str, bool]] = []
    final_tokens, final_text, final_ends, final_decodes = _run(
        tiny_llama, k, kind=RequestOutputKind.FINAL_ONLY, texts=texts
    )
    assert final_tokens == tokens and final_ends == ends and final_text == text
    assert all(t == "" for t, last in texts if not last) and sum(1 for t, last in texts if last and t) == len(PROMPTS)
    assert final_decodes <= 4 * len(PROMPTS) < decodes


def test_text_at_the_end_with_stop_strings_is_cut_as_token_by_token(tiny_llama: LoadedModel) -> None:
    """``FINAL_ONLY`` with a stop string (decoded a token at a time: the string is found in the text): the tokens, the
    cut and the finish of ``DELTA``, the text in the last delta alone."""
    _, text, _, _ = _run(tiny_llama, 1)
    stop = (text["r2"][12:15],)  # (found in the third output's text, maybe in the others too)
    tokens, text, ends, _ = _run(tiny_llama, 1, stop=stop)
    texts: list[tuple[str, bool]] = []
    final_tokens, final_text, final_ends, _ = _run(
        tiny_llama, 1, kind=RequestOutputKind.FINAL_ONLY, stop=stop, texts=texts
    )
    assert ends["r2"][0] == "stop" and final_tokens == tokens and final_ends == ends and final_text == text
    assert all(t == "" for t, last in texts if not last)


@pytest.mark.parametrize("model", ["tiny_llama", "smollm2"])
def test_a_whole_output_at_the_end_gives_the_text_of_a_token_at_a_time(
    model: str, request: pytest.FixtureRequest
) -> None:
    """``flush`` of a whole output at once (a final-only request's end) against ``add_tokens`` a token at a time, for
    every length of each stream: the same text, also where the output ends inside a character."""
    loaded: LoadedModel = request.getfixturevalue(model)
    params = SamplingParams(max_tokens=1000)
    final = SamplingParams(max_tokens=1000, output_kind=RequestOutputKind.FINAL_ONLY)
    inside = 0
    for stream in _streams(loaded, seed=7):
        one = IncrementalDetokenizer(loaded.tokenizer, [1, 2, 3], params)
        for n, token in enumerate(stream, start=1):
            one.add(token)
            if n % 7 and n != len(stream):
                continue  # (every seventh length, and the whole stream)
            whole = IncrementalDetokenizer(loaded.tokenizer, [1, 2, 3], final)
            for t in stream[:n]:
                assert not whole.add(t)
            assert whole.text == "" and whole.take_delta(finished=False) == ""
            flush([whole])
            assert whole.text == one.text and whole.take_delta(finished=True) == one.text
            inside += one.text_pending
    assert inside > 0  # (some outputs ended inside a character)


def _byte_fallback_tokenizer(root: Path) -> object:
    """A small Llama-2-style tokenizer with a byte fallback (``write_byte_fallback_tokenizer``)."""
    corpus = ["hello world, the quick brown fox jumps over the lazy dog. héllo wörld café naïve"] * 20
    return load_tokenizer(write_byte_fallback_tokenizer(root, corpus, 200))


def test_a_tokenizer_that_falls_back_to_bytes_takes_runs_a_token_at_a_time(tmp_path: Path) -> None:
    """A byte fallback's text depends on where a decoded window begins (a group of byte tokens with a bad byte is a
    replacement character a byte, the valid characters before it included): its windows' runs and final-only outputs
    go a token at a time, and give a token at a time's text, where one decode of a run gave more replacement
    characters (the reviews' cases: two characters then a byte that never ends one; "åa", a stray byte, then a word
    in windows of 3 and 2)."""
    tokenizer = _byte_fallback_tokenizer(tmp_path / "spm")
    assert tokenizer.byte_fallback  # type: ignore[attr-defined]
    byte = {b: tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}  # type: ignore[attr-defined]
    text = tokenizer.encode("hello café wörld", add_special_tokens=False)  # type: ignore[attr-defined]
    nihon = [byte[b] for b in "日本".encode()]
    rng = random.Random(11)
    streams = [
        nihon + [byte[0xE8]] + text,
        [byte[0xC3], byte[0xA5], byte[0x61], byte[0xA5]] + text,
        text + nihon + text,
        [rng.randrange(len(byte) + 3, len(byte) + 200) for _ in range(60)]
        + [rng.choice(list(byte.values())) for _ in range(60)],
    ]
    params = SamplingParams(max_tokens=1000)
    final = SamplingParams(max_tokens=1000, output_kind=RequestOutputKind.FINAL_ONLY)
    for stream in streams:
        one = IncrementalDetokenizer(tokenizer, [1], params)
        for token in stream:
            one.add(token)
        whole = IncrementalDetokenizer(tokenizer, [1], final)
        for token in stream:
            whole.add(token)
        assert whole.take_delta(finished=True) == one.text
        for sizes in ((5,), (3, 2), (1, 4, 2)):
            windows = IncrementalDetokenizer(tokenizer, [1], params)
            start, k = 0, 0
            while start < len(stream):
                add_runs([windows], [stream[start : start + sizes[k % len(sizes)]]])
                start, k = start + sizes[k % len(sizes)], k + 1
            assert windows.text == one.text, (stream, sizes)
