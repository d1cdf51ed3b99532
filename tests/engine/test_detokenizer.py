"""``SamplingParams.detokenize``: a request that asks for no text gets the tokens and finish of one that does, and
no decoding is done for it."""

from __future__ import annotations

import pytest

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import InvalidSamplingParams, SamplingParams
from boundless.model.loader import LoadedModel

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


def _run(loaded: LoadedModel, k: int, detokenize: bool) -> tuple[dict, dict, dict, int]:
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
        params = SamplingParams(temperature=0.0, max_tokens=9 + 7 * i, ignore_eos=True, detokenize=detokenize)
        core.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"], text[f"r{i}"] = [], ""
    while core.has_unfinished():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
            text[delta.request_id] += delta.new_text
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
