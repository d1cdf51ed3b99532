"""A thinking budget (``SamplingParams.thinking_budget``): after that many tokens of thinking the end tag is forced,
a token at a time, and the output is then free; nothing is forced before, or once the model has closed its thinking."""

from __future__ import annotations

import dataclasses

import pytest

from boundless.engine.core import EngineCore
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.thinking_budget import ThinkingBudget
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

START, END = (7,), (300, 301)  # a one-token start tag, a two-token end tag (as a BPE without a token for it has)


@pytest.mark.parametrize(
    ("outputs", "expected"),
    [
        ([], None),  # nothing thought yet
        ([1, 2], None),  # within the budget
        ([1, 2, 3], 300),  # spent: the end tag's first token
        ([1, 2, 3, 300], 301),  # then its second
        ([1, 2, 3, 300, 301], None),  # closed: free again
        ([1, 2, 3, 300, 301, 9, 9], None),
        ([1, 300, 301, 9, 9, 9], None),  # closed by the model itself, early
        ([1, 2, 300], 301),  # the model began the tag itself as the budget ran out
    ],
)
def test_when_the_end_is_forced_in_a_prompt_opened_thinking(outputs: list[int], expected: int | None) -> None:
    assert ThinkingBudget(3, END).forced(outputs) == expected


def test_an_output_thinks_only_when_it_begins_with_the_start_tag() -> None:
    budget = ThinkingBudget(2, END, START)
    assert budget.forced([7, 1, 2]) == 300  # the start tag is not counted
    assert budget.forced([7, 1]) is None
    assert budget.forced([1, 7, 2, 3, 4]) is None and budget.closed([1, 7, 2, 3])  # no thinking
    assert not budget.closed([]) and not budget.closed([7, 1, 2])
    assert ThinkingBudget(0, END).forced([]) == 300  # no thinking at all
    assert budget.within(2) and not budget.within(3)  # (the start tag not counted)
    with pytest.raises(ValueError):
        ThinkingBudget(-1, END)
    with pytest.raises(ValueError):
        ThinkingBudget(3, ())


def _core(loaded: LoadedModel, **options: object) -> EngineCore:
    config = engine_config("m", max_model_len=256, num_kv_blocks=64, policy="fcfs", **options)
    return EngineCore.from_model(loaded, config)


def _outputs(core: EngineCore, params: list[SamplingParams]) -> list[list[int]]:
    prompts = [[5, 6, 7, 8, 9, 5, 6], list(range(20, 44)), [3, 1, 4, 1, 5, 9, 2, 6]]
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        core.add_request(f"r{i}", prompts[i], p)
        tokens[f"r{i}"] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(params))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_scheduler_steps": 4},  # a window's passes sampled on the host, one by one
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}},
    ],
)
def test_the_budget_closes_the_thinking_and_leaves_the_rest_to_the_model(
    tiny_llama: LoadedModel, options: dict
) -> None:
    """Greedy: the first tokens are the model's own, then the end tag, then what the model says after it, which is
    what it says unbudgeted after the same tokens. Alike with multi-step windows and speculative decoding."""
    free = _outputs(_core(tiny_llama), [GREEDY] * 3)
    budgets = [ThinkingBudget(5, END), ThinkingBudget(0, END), ThinkingBudget(30, END)]
    budgeted = _outputs(_core(tiny_llama, **options), [dataclasses.replace(GREEDY, thinking_budget=b) for b in budgets])
    assert budgeted[0][:5] == free[0][:5] and budgeted[0][5:7] == list(END)
    assert budgeted[1][:2] == list(END)
    assert budgeted[2] == free[2]  # a budget larger than the output: nothing forced
    # What follows the tag is the model's own: the same as a free request given the same tokens in its prompt.
    prompt = [5, 6, 7, 8, 9, 5, 6, *budgeted[0][:7]]
    core = _core(tiny_llama)
    core.add_request("after", prompt, dataclasses.replace(GREEDY, max_tokens=24 - 7))
    after: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            after += delta.new_token_ids
    assert budgeted[0][7:] == after


def test_a_sampled_request_is_forced_too(tiny_llama: LoadedModel) -> None:
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    (out,) = _outputs(_core(tiny_llama), [dataclasses.replace(sampled, thinking_budget=ThinkingBudget(4, END))])
    assert out[4:6] == list(END)


def test_a_tag_outside_the_vocabulary_is_refused(tiny_llama: LoadedModel) -> None:
    params = dataclasses.replace(GREEDY, thinking_budget=ThinkingBudget(4, (10**6,)))
    with pytest.raises(InvalidRequestError) as err:
        _core(tiny_llama).add_request("r", [1, 2, 3], params)
    assert err.value.param == "thinking_token_budget"
