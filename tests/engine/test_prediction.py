"""OpenAI's Predicted Outputs (``SamplingParams.prediction``): drafts from a request's own prediction, verified as
speculative decoding's are: the same tokens as without a prediction, in fewer steps when the prediction is right;
where the prediction has none, prompt lookup's over the request's own tokens, not counted as prediction tokens."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from boundless.engine.core import EngineCore
from boundless.engine.errors import InvalidRequestError
from boundless.engine.prediction import PredictionProposer
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

PROMPTS = [[5, 6, 7, 8, 9, 5, 6], list(range(20, 44)), [3, 1, 4, 1, 5, 9, 2, 6]]


def _core(loaded: LoadedModel, **options: object) -> EngineCore:
    config = engine_config("m", max_model_len=256, num_kv_blocks=64, policy="fcfs", **options)
    return EngineCore.from_model(loaded, config)


def _run(
    core: EngineCore, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS
) -> tuple[dict[str, list[int]], dict[str, tuple], Counter]:
    """Each request's tokens, its (accepted, rejected) prediction tokens at the end, and the steps that gave it
    tokens."""
    tokens: dict[str, list[int]] = {}
    counts: dict[str, tuple] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"r{i}", prompt, p)
        tokens[f"r{i}"] = []
    steps: Counter = Counter()
    while core.has_unfinished():
        for delta in core.step():
            steps[delta.request_id] += 1
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finished:
                counts[delta.request_id] = (delta.num_accepted_prediction_tokens, delta.num_rejected_prediction_tokens)
    assert core.kv.pool.num_used == 0  # every block given back, drafts' too
    return tokens, counts, steps


def _greedy(prediction: list[int] = ()) -> SamplingParams:  # type: ignore[assignment]
    return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prediction=tuple(prediction))


@pytest.mark.parametrize("options", [{}, {"enable_prefix_caching": False}, {"num_scheduler_steps": 4}])
def test_a_right_prediction_gives_the_same_tokens_in_fewer_steps(tiny_llama: LoadedModel, options: dict) -> None:
    plain, counts, plain_steps = _run(_core(tiny_llama, **options), [_greedy()] * 3)
    assert all(c == (0, 0) for c in counts.values())
    # Request 0 predicted exactly, request 1 with an edit in the middle, request 2 with its first token then noise.
    edited = plain["r1"][:15] + [300, 301, 302] + plain["r1"][18:]
    noise = plain["r2"][:1] + random.Random(0).choices(range(384), k=40)
    predicted, counts, steps = _run(
        _core(tiny_llama, **options), [_greedy(plain["r0"]), _greedy(edited), _greedy(noise)]
    )
    assert predicted == plain
    assert counts["r0"][0] >= 30  # (drafts of 8: the last token of each step is the model's own)
    assert counts["r1"][0] >= 25 and counts["r1"][1] > 0  # back on the prediction after the edit
    assert counts["r2"][0] < 8 and counts["r2"][1] > 0  # noise: drafted, and rejected
    # Most of its tokens come 9 a step (a window of 4 passes without a prediction)
    assert steps["r0"] * (3 if "num_scheduler_steps" not in options else 1.5) < plain_steps["r0"]


def test_sampled_outputs_are_the_same_with_a_prediction(tiny_llama: LoadedModel) -> None:
    """A seeded sample keeps its tokens whatever is drafted (a draft is kept only where the sample equals it)."""
    seeded = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
    plain, _, _ = _run(_core(tiny_llama), seeded)
    with_prediction = [dataclasses.replace(s, prediction=tuple(plain[f"r{i}"])) for i, s in enumerate(seeded)]
    again, counts, _ = _run(_core(tiny_llama), with_prediction)
    assert again == plain and sum(a for a, _ in counts.values()) > 0


def test_the_proposer_follows_the_prediction_and_finds_its_way_back() -> None:
    p = PredictionProposer(num_drafts=3)
    prompt = [1, 2]
    p.add("r", [10, 11, 12, 13, 14, 15, 16, 17, 13, 14, 20])
    assert p.propose("r", prompt, 2, 10) == [10, 11, 12]  # nothing written yet: the prediction's start
    assert p.propose("r", prompt + [10, 11, 12, 13], 2, 10) == [14, 15, 16]  # its end follows
    # An edit (99), then back on the prediction: "13 14" occurs twice, the place after the last drafts is taken.
    out = prompt + [10, 11, 12, 13, 14, 15, 16, 99, 13, 14]
    assert p.propose("r", out, 2, 10) == [20]
    assert p.propose("r", prompt + [50, 51], 2, 2) == []  # nowhere in the prediction
    assert p.propose("r", prompt + [10, 11], 2, 1) == [12]  # the caller's limit
    assert p.active and p.has("r")
    p.finish("r")
    assert not p.active and p.propose("r", prompt, 2, 10) == []


def test_the_drafts_grow_while_they_are_kept_and_shrink_when_they_are_not() -> None:
    """Four drafts first; all kept: twice as many next time (up to 16); one rejected: one more than were kept."""
    p = PredictionProposer()
    prediction = list(range(100, 160))
    p.add("r", prediction)
    out = [1]
    lengths = []
    for _ in range(4):  # the model writes the prediction: every draft kept, then the model's own next token
        drafts = p.propose("r", out, 1, 100)
        lengths.append(len(drafts))
        out += drafts + [prediction[len(out) - 1 + len(drafts)]]
    assert lengths == [4, 8, 16, 16]
    drafts = p.propose("r", out, 1, 100)
    out += drafts[:2] + [7]  # two kept, then the model writes something else
    assert len(p.propose("r", out + [8, 9], 1, 100)) == 0  # (off the prediction, and "7 8 9" new: no drafts)
    out += prediction[50:52]
    assert p.propose("r", out, 1, 100) == prediction[52:55]  # back on it: 3 drafts (2 kept + 1)


def test_where_the_prediction_has_nothing_the_drafts_are_prompt_lookups() -> None:
    """The output's end nowhere in the prediction: the tokens that followed its latest earlier occurrence in the
    request's own prompt and output (the n-gram proposer's lookup), as many as the request's length allows, and
    marked as not the prediction's; the prediction's own drafts first wherever it has some."""
    p = PredictionProposer(num_drafts=4)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    p.add("r", [10, 11, 12, 13, 14, 15])
    assert p.propose("r", prompt + [10], 7, 10) == [11, 12, 13, 14] and p.from_prediction
    out = prompt + [10, 11, 12, 13, 14, 15, 3, 4]  # all four kept; then the answer quotes its prompt
    assert p.propose("r", out, 7, 10) == [5, 6, 7, 10] and not p.from_prediction
    out += [5, 6, 9]  # two of the lookup's drafts kept: three next (how they fared sets the length)
    assert p.propose("r", out + [2, 3], 7, 10) == [4, 5, 6] and not p.from_prediction
    out += [2, 3, 4, 5, 6, 7, 12, 13]  # back on the prediction: its drafts again
    assert p.propose("r", out, 7, 10) == [14, 15] and p.from_prediction
    assert p.propose("r", out + [8, 8], 7, 10) == [] and not p.from_prediction  # "8 8" in neither
    assert p.propose("other", prompt + [3, 4], 7, 10) == []  # no prediction: nothing drafted for it here
    p.finish("r")
    p.add("r", [10, 11])  # a new request under the same id, longer: its own tokens looked up, not the last one's
    assert p.propose("r", [*range(40, 70), 45, 46], 30, 10) == [47, 48, 49, 50]


def test_prediction_must_be_token_ids() -> None:
    with pytest.raises(ValueError, match="prediction"):
        SamplingParams(prediction=(1, -2))


def test_drafts_kept_past_a_stop_are_not_counted_as_accepted(tiny_llama: LoadedModel) -> None:
    """A stop token among a pass's kept drafts ends the output there: the drafts after it are not in the completion,
    so they count as rejected (OpenAI's accepted_prediction_tokens are the prediction's tokens the completion holds)."""
    plain, _, _ = _run(_core(tiny_llama), [_greedy()] * 3)
    out = plain["r0"]
    at = next(i for i in range(8, 40) if out[i] not in out[:i])  # (its first place: the output ends there)
    params = [_greedy(plain[f"r{i}"]) for i in range(3)]
    params[0] = dataclasses.replace(params[0], stop_token_ids=(out[at],))
    tokens, counts, _ = _run(_core(tiny_llama), params)
    assert tokens["r0"] == out[: at + 1]
    accepted, rejected = counts["r0"]
    assert 0 < accepted <= len(tokens["r0"]) - 1 and rejected > 0  # (its first token is the prefill's, no draft's)


def test_a_prediction_outside_the_vocabulary_is_refused(tiny_llama: LoadedModel) -> None:
    """Its tokens are drafts the model reads: one outside the vocabulary failed the step of every request in it (an
    IndexError in the embedding), as a prompt's would; it is refused as the request arrives, as a prompt's is."""
    core = _core(tiny_llama)
    plain, _, _ = _run(core, [_greedy()] * 3)
    with pytest.raises(InvalidRequestError, match="prediction"):
        core.add_request("bad", PROMPTS[0], _greedy([*plain["r0"][:2], 10**6]))
    again, _, _ = _run(core, [_greedy(plain[f"r{i}"]) for i in range(3)])
    assert again == plain


# An answer that copies its prompt: SmolLM2 asked to copy a list writes its items (and then some again).
COPY = (
    "Copy the list exactly.\nList: apples, pears, plums, figs, dates, limes, kiwis, grapes, melons, lemons, cherries, "
    "peaches\nCopy: apples,"
)


def test_a_wrong_prediction_drafts_by_prompt_lookup(smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prediction that has none of the answer's tokens drafts nothing itself; the answer copies its prompt, so the
    request's drafts are prompt lookup's over its own tokens: the tokens without a prediction, in under half the
    steps, and none of them counted as prediction tokens. A prediction right at first, then wrong: its own drafts
    counted as they fared, the lookup's drafts after them not (the counts are those of the same request without the
    lookup)."""
    prompt = smollm2.tokenizer.encode(COPY, add_special_tokens=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _, plain_steps = _run(_core(smollm2), [greedy], [prompt])
    answer = plain["r0"]
    assert plain_steps["r0"] == 40
    unrelated = tuple(t for t in range(1000, 1100) if t not in prompt and t not in answer)[:40]
    mixed = (*answer[:8], *unrelated)  # (the answer's later pairs of tokens are not in it: only its start drafts)
    params = [dataclasses.replace(greedy, prediction=unrelated), dataclasses.replace(greedy, prediction=mixed)]
    core = _core(smollm2)
    tokens, counts, steps = _run(core, params, [prompt, prompt])
    assert tokens == {"r0": answer, "r1": answer}
    assert counts["r0"] == (0, 0)  # the prediction drafted nothing: every draft was the lookup's
    assert core.stats().spec_accepted_tokens >= 40  # (both requests' kept drafts)
    assert 2 * steps["r0"] < plain_steps["r0"]
    # Without the lookup, the unrelated prediction drafts nothing at all, and the mixed one only its beginning.
    off = _core(smollm2)
    monkeypatch.setattr(off.scheduler.predictions._lookup, "propose", lambda *args: [])
    tokens_off, counts_off, steps_off = _run(off, params, [prompt, prompt])
    assert tokens_off == tokens
    assert steps_off["r0"] == plain_steps["r0"] and steps["r1"] < steps_off["r1"]
    assert counts["r1"] == counts_off["r1"] and 0 < counts["r1"][0] <= 7 and counts["r1"][1] > 0
