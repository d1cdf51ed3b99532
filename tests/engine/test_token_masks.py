"""``allowed_token_ids`` and ``bad_words`` on a real engine: SmolLM2's greedy text changes exactly where a banned word
would be completed; allowed tokens hold greedy and seeded samples (n > 1); n-gram speculation gives the tokens plain
decoding gives under the same masks; the parameters travel to another instance (pickled) whole."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest

from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, engine_config
from boundless.model.loader import LoadedModel

MODEL = "smollm2-135m"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llm(smollm2: LoadedModel) -> Iterator[LLM]:
    offline = LLM.from_config(engine_config(MODEL, max_model_len=256, kv_cache_gb=0.05), smollm2)
    yield offline
    offline.close()


def _encode(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def test_a_banned_word_is_never_completed_and_the_greedy_text_changes_exactly_there(
    llm: LLM, smollm2: LoadedModel
) -> None:
    prompts = ["The capital of France is", "Once upon a time, there was a little girl named"]
    greedy = {"temperature": 0.0, "max_tokens": 20}
    asked = [SamplingParams(**greedy)] * 2
    asked += [SamplingParams(bad_words=["Paris"], **greedy), SamplingParams(bad_words=["the beach"], **greedy)]
    *plain, paris, beach = (o.outputs[0].token_ids for o in llm.generate(prompts * 2, asked))
    # A word of one token (" Paris" mid-text, "Paris" at the start): the first token differs, and neither ever comes.
    assert plain[0][0] == _encode(smollm2, " Paris")[0] != paris[0]
    assert not {*_encode(smollm2, "Paris"), *_encode(smollm2, " Paris")} & set(paris)
    # A word of two tokens (" the" " beach"): the text is the same through " the", then " beach" never follows it.
    word = _encode(smollm2, " the beach")
    at = next(i for i in range(len(plain[1])) if plain[1][i : i + 2] == word)
    assert beach[: at + 1] == plain[1][: at + 1] and beach[at + 1] != word[1]
    assert all(beach[i : i + 2] != word for i in range(len(beach)))


def test_allowed_token_ids_hold_greedy_and_seeded_samples_of_every_choice(llm: LLM, smollm2: LoadedModel) -> None:
    allowed = {*_encode(smollm2, " the beach and the sun, a dog"), *smollm2.tokenizer.eos_token_ids}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=sorted(allowed))
    seeded = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=8, allowed_token_ids=sorted(allowed))
    (greedy_out, first), (_, again) = (llm.generate(["Once upon a time,"] * 2, [greedy, seeded]) for _ in range(2))
    outs = [o.token_ids for o in first.outputs]
    assert len(outs) == 3 and len({tuple(o) for o in outs}) > 1  # (each choice its own seed)
    assert [o.token_ids for o in again.outputs] == outs  # seeded: the same samples again
    assert all(set(o) <= allowed for o in [*outs, greedy_out.outputs[0].token_ids])


def _run(loaded: LoadedModel, spec: dict | None, params: SamplingParams, prompts: list[list[int]]) -> tuple[list, int]:
    options: dict = {"max_model_len": 256, "num_kv_blocks": 64, "policy": "fcfs"}
    if spec is not None:
        options["speculative_config"] = spec
    core = EngineCore.from_model(loaded, engine_config("m", **options))
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))], core.stats().spec_accepted_tokens


# A prompt after which the random model loops (329 125 14 329 125 14 ...): n-gram drafts continue the loop.
LOOPING = [100, 101, 102] * 12


@pytest.mark.parametrize(
    "masks",
    [
        pytest.param({"allowed_token_ids": (2, 14, 100, 102, 125, 329)}, id="allowed"),
        pytest.param({"bad_words_token_ids": ((329, 125), (125, 14))}, id="bad-words"),
    ],
)
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_speculation_gives_plain_decodings_tokens_under_the_masks(
    tiny_llama: LoadedModel, masks: dict, sampling: dict
) -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True, **masks, **sampling)
    assert pickle.loads(pickle.dumps(params)) == params  # (as it travels to a Ray instance)
    prompts = [LOOPING, [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]]
    plain, _ = _run(tiny_llama, None, params, prompts)
    speculated, accepted = _run(tiny_llama, NGRAM, params, prompts)
    assert speculated == plain
    for out in plain:
        assert set(out) <= set(params.allowed_token_ids or out)
        assert not any(tuple(out[i : i + 2]) in params.bad_words_token_ids for i in range(len(out)))
    if params.allowed_token_ids:
        assert accepted > 0  # (the loop's drafts were kept)
