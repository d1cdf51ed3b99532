"""The sampler on hand-made logits: greedy rows beside sampled ones, min_tokens, logprobs."""

from __future__ import annotations

import torch

from boundless.engine.sampler import Sampler
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import ScheduledChunk


def chunk(rid: str, params: SamplingParams, outputs: int = 0) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], 0, [0], True, params, outputs, eos_token_ids=(2,))


def test_greedy_rows_beside_sampled_rows() -> None:
    logits = torch.full((3, 50), -5.0)
    logits[0, 7] = logits[0, 9] = 3.0  # a tie: the first index, as torch.argmax
    logits[1, 11] = 40.0  # sampled, but all but certain
    logits[2, 2] = 9.0  # EOS is the best, but min_tokens forbids it
    logits[2, 30] = 8.0
    chunks = [
        chunk("g", SamplingParams(temperature=0.0, logprobs=2)),
        chunk("s", SamplingParams(temperature=1.0, seed=3)),
        chunk("m", SamplingParams(temperature=0.0, min_tokens=4), outputs=1),
    ]
    out = Sampler(torch.device("cpu")).sample(logits, chunks)
    assert [t.token_id for t in out] == [7, 11, 30]
    assert out[0].rank == 1 and [i for i, _ in out[0].top_logprobs] == [7, 9]
    assert out[1].logprob is None


def test_all_greedy_batch_matches_torch_argmax() -> None:
    logits = torch.randn(32, 1001, generator=torch.Generator().manual_seed(0))
    chunks = [chunk(f"r{i}", SamplingParams(temperature=0.0)) for i in range(32)]
    tokens = [t.token_id for t in Sampler(torch.device("cpu")).sample(logits, chunks)]
    assert tokens == logits.argmax(dim=-1).tolist()
