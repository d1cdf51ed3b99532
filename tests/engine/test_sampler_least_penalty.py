"""A repetition penalty as small as a double goes (its range is (0, 100]) leaves the sampler's rows finite."""

from __future__ import annotations

import dataclasses

import torch
from test_sampler import _penalized

from boundless.engine.sampler import Sampler
from boundless.engine.sampling_params import SamplingParams


def test_the_least_double_as_repetition_penalty_keeps_the_rows_order() -> None:
    """5e-324 divided a logit past even float64's range: the widened row was infinite, inf - inf made it NaN, and the
    step failed (every request of it). The likelier seen token still wins, greedy or drawn."""
    penalty = 5e-324
    logits = torch.zeros(2, 10)
    logits[:, 3], logits[:, 5] = 2.0, 9.0  # both seen: 5 the likelier
    logits[:, 7] = float("-inf")  # (a masked token: not counted in the row's largest logit)
    greedy = _penalized("g", [3, 5], [], repetition_penalty=penalty)
    plain = _penalized("p", [3, 5], [], repetition_penalty=2.0)
    sampler = Sampler(torch.device("cpu"))
    assert [t.token_id for t in sampler.sample(logits.clone(), [greedy, plain])] == [5, 5]
    drawn = _penalized("d", [3, 5], [], repetition_penalty=penalty)
    drawn = dataclasses.replace(drawn, sampling_params=SamplingParams(temperature=1.0, repetition_penalty=penalty))
    assert {sampler.sample(logits.clone(), [drawn])[0].token_id for _ in range(20)} == {5}
    adjusted = sampler._adjusted(logits.clone(), [greedy], [(0, ())], [], [], [])
    assert not torch.isnan(adjusted[0]).any() and adjusted[0, 5] == adjusted[0].max()


def test_a_tiny_penalty_under_a_grammar_leaves_the_grammars_tokens_drawable(tiny_llama) -> None:
    """A penalty of 2.4e-107 made the prompt's seen tokens so likely that, shifted into float32, every other token
    fell to -inf; the grammar then forbade the seen ones and the row had nothing left: NaN, the engine's step failed
    (a 500; the slow fuzz test found it). The others stay finite at float32's floor, so the grammar's tokens remain."""
    from boundless.config import EngineConfig, ModelConfig
    from boundless.engine.core import EngineCore
    from boundless.engine.structured_output import StructuredOutput

    core = EngineCore.from_model(tiny_llama, EngineConfig(model=ModelConfig(max_model_len=256)))
    for temperature in (0.0, 0.7):
        params = SamplingParams(
            temperature=temperature,
            max_tokens=3,
            repetition_penalty=2.4e-107,
            structured=StructuredOutput("json_object"),
        )
        core.add_request(f"r{temperature}", [5, 6, 7, 8], params)
    finished = {}
    while core.has_unfinished():
        for delta in core.step():
            if delta.finished:
                finished[delta.request_id] = delta.finish_reason
    assert finished == {"r0.0": "length", "r0.7": "length"}
    core.close()
