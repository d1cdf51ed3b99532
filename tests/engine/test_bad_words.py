"""vLLM's ``bad_words``: how a word becomes token sequences (SmolLM2's tokenizer), and which token each bans next."""

from __future__ import annotations

import pytest

from boundless import LLM, SamplingParams
from boundless.engine.bad_words import bad_words_token_ids, banned_tokens, longest_prefix
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import InvalidSamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel


def test_a_word_is_banned_as_written_and_after_a_space_where_that_is_as_many_other_tokens(smollm2: LoadedModel) -> None:
    """vLLM's ``update_from_tokenizer``: each word (blanks before it dropped) as it tokenizes at the text's start, then
    after a space (byte-level BPE's ``Ġ`` tokens: mid-text), unless that is a different number of tokens or begins
    with the same one."""

    def encode(text: str) -> list[int]:
        return smollm2.tokenizer.encode(text, add_special_tokens=False)

    assert len(encode("Paris")) == len(encode(" Paris")) == 1 and encode("Paris") != encode(" Paris")
    assert len(encode("the beach")) == len(encode(" the beach")) == 2
    assert len(encode("Emma")) == 2 and len(encode(" Emma")) == 1  # ("Em" "ma" at the start, " Emma" mid-text)
    assert len(encode("Champ de Mars")) == 4 and len(encode(" Champ de Mars")) == 3
    words = ["Paris", "  the beach", "Emma", "Champ de Mars"]
    assert bad_words_token_ids(words, encode) == (
        tuple(encode("Paris")),
        tuple(encode(" Paris")),
        tuple(encode("the beach")),
        tuple(encode(" the beach")),
        tuple(encode("Emma")),  # (vLLM's rule leaves " Emma" free: its one token is not as many as "Em" "ma")
        tuple(encode("Champ de Mars")),
    )


def test_a_word_of_no_tokens_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError) as err:
        bad_words_token_ids([" \t"], lambda text: list(text.encode()))  # (nothing left once its blanks are dropped)
    assert err.value.param == "bad_words"


def test_a_sequence_bans_its_last_token_where_the_tokens_before_it_end_the_output() -> None:
    words = ((7,), (1, 2, 3), (4, 5))
    assert longest_prefix(words) == 2
    assert banned_tokens(words, []) == [7]  # a one-token word always; the others' first tokens are not out yet
    assert banned_tokens(words, [9, 1, 2]) == [7, 3]
    assert banned_tokens(words, [1, 2, 4]) == [7, 5]
    assert banned_tokens(words, [2]) == [7]  # (1 2 3 needs both before it)
    assert banned_tokens(words, [1, 2, 3]) == [7]  # completed already: nothing left to ban for it


def test_bad_words_with_bad_words_token_ids_is_refused_not_replaced() -> None:
    """vLLM derives its token sequences from the words alone; given both, the words' sequences silently replaced the
    ids the caller gave, which were then never banned."""
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(bad_words=["Paris"], bad_words_token_ids=[[42]])
    assert err.value.param == "bad_words" and "not both" in str(err.value)
    assert SamplingParams(bad_words_token_ids=[[42]]).bad_words_token_ids == ((42,),)  # either alone is taken


def test_the_engine_bans_a_words_sequences_in_place_of_the_words(smollm2: LoadedModel) -> None:
    """What the engine keeps of a request with ``bad_words``: their sequences alone, so that the request is valid
    again where it goes next (another instance, after a migration or a failover)."""
    llm = LLM.from_config(engine_config(smollm2.name, max_model_len=256, kv_cache_gb=0.02), smollm2)
    params = SamplingParams(temperature=0.0, max_tokens=1, bad_words=["Paris"])
    core = llm.engine
    core.add_request("r", smollm2.tokenizer.encode("The capital of France is"), params)
    kept = core.scheduler.requests["r"].sampling_params
    encode = smollm2.tokenizer.encode
    assert kept.bad_words == () and kept.bad_words_token_ids == (
        tuple(encode("Paris", add_special_tokens=False)),
        tuple(encode(" Paris", add_special_tokens=False)),
    )
    core.add_request("moved", smollm2.tokenizer.encode("The capital of France is"), kept)  # (as a migration adds it)
    assert core.scheduler.requests["moved"].sampling_params == kept
    while core.has_unfinished():
        core.step()
