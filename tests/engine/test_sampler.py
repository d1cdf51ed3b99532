"""The sampler on hand-made logits: greedy rows beside sampled ones, min_tokens, logprobs, min-p, logit biases,
penalties, allowed tokens and bad words."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from boundless.engine.sampler import Sampler
from boundless.engine.sampling_params import InvalidSamplingParams, SamplingParams
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


def test_a_windows_logits_in_the_models_dtype_draw_what_their_fp32_copy_draws() -> None:
    """A CUDA graph hands a window's logits over in the model's dtype: greedy rows take their argmax as they are, the
    drawing rows in fp32; the tokens are those of the same logits in fp32 (ties in bf16 included: the first index),
    for an all-greedy batch and one with seeded and unseeded draws."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 300, generator=gen) * 3).to(torch.bfloat16)
    logits[0, 5] = logits[0, 40] = 20.0  # a tie in bf16
    params = [SamplingParams(temperature=0.0)] * 3 + [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.0, top_k=5, seed=12),
        SamplingParams(temperature=0.0),
    ]
    for rows in (params[:3], params):
        chunks = [chunk(f"r{i}", p) for i, p in enumerate(rows)]
        drawn = []
        for values in (logits[: len(rows)], logits[: len(rows)].float()):
            sampler = Sampler(torch.device("cpu"))  # (fresh generators: the seeded rows draw alike)
            drawn.append(sampler.draw_planned(values, sampler.plan_draw(chunks, values.device, 300)).tolist())
        assert drawn[0] == drawn[1]
        assert drawn[0][0] == 5


def test_unseeded_rows_draw_together_each_from_its_own_row_and_seeded_rows_alone() -> None:
    """Rows without a seed are drawn in one call from the shared generator: each from its own distribution (row i
    puts all but nothing outside tokens 2i and 2i + 1, evenly); a seeded row draws the same tokens whatever the rows
    around it."""
    n, vocab = 6, 40
    logits = torch.full((n, vocab), -30.0)
    for i in range(n):
        logits[i, 2 * i] = logits[i, 2 * i + 1] = 0.0
    sampler = Sampler(torch.device("cpu"))
    counts = torch.zeros(n, vocab)
    for step in range(200):
        out = sampler.sample(logits, [chunk(f"r{i}-{step}", SamplingParams(temperature=1.0)) for i in range(n)])
        for i, token in enumerate(out):
            counts[i, token.token_id] += 1
    for i in range(n):
        assert counts[i, 2 * i] + counts[i, 2 * i + 1] == 200  # its own row's tokens only
        assert 60 < counts[i, 2 * i] < 140  # both of them, about evenly

    def seeded_tokens(batch: int) -> list[int]:
        fresh = Sampler(torch.device("cpu"))
        tokens = []
        for step in range(20):
            chunks = [chunk("s", SamplingParams(temperature=1.0, seed=7))]
            chunks += [chunk(f"o{i}-{step}", SamplingParams(temperature=1.0)) for i in range(batch)]
            tokens.append(fresh.sample(logits[: batch + 1], chunks)[0].token_id)
        return tokens

    alone = seeded_tokens(0)
    assert alone == seeded_tokens(5) and len(set(alone)) == 2


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    # Probabilities 0.5, 0.3, 0.15 and the rest spread thin: min_p 0.5 keeps tokens of at least 0.25, i.e. 0 and 1.
    probs = torch.full((64,), 0.05 / 61)
    probs[:3] = torch.tensor([0.5, 0.3, 0.15])
    logits = probs.log().repeat(2, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.5), SamplingParams(temperature=1.0)]
    sampler = Sampler(torch.device("cpu"))
    seen: list[set[int]] = [set(), set()]
    for step in range(300):
        out = sampler.sample(logits, [chunk(f"r{i}-{step}", p) for i, p in enumerate(params)])
        for i, token in enumerate(out):
            seen[i].add(token.token_id)
    assert seen[0] == {0, 1}
    assert len(seen[1]) > 3  # without min_p the thin tail is drawn too


def test_logit_bias_moves_greedy_and_sampled_rows_and_not_their_logprobs() -> None:
    logits = torch.zeros(2, 20)
    logits[:, 3] = 5.0
    bias = ((3, -100.0), (8, 2.0))
    chunks = [
        chunk("g", SamplingParams(temperature=0.0, logit_bias=bias, logprobs=1)),
        chunk("s", SamplingParams(temperature=0.5, seed=0, logit_bias=bias)),
    ]
    out = Sampler(torch.device("cpu")).sample(logits, chunks)
    assert [t.token_id for t in out] == [8, 8]  # 3 forbidden; 8 is e^4 times likelier than any other at T=0.5
    assert out[0].top_logprobs[0][0] == 3  # logprobs are the model's own, before the bias
    assert logits[0, 3] == 5.0  # the caller's logits are left alone


def _penalized(rid: str, prompt: list[int], outputs: list[int], **params) -> ScheduledChunk:
    return ScheduledChunk(
        rid,
        [outputs[-1] if outputs else prompt[-1]],
        len(prompt) + len(outputs) - 1,
        [0],
        True,
        SamplingParams(temperature=0.0, **params),
        len(outputs),
        (),
        history=prompt + outputs,
        num_prompt_tokens=len(prompt),
    )


@pytest.mark.parametrize("penalty", [1e-38, 1e-300])
def test_a_tiny_repetition_penalty_keeps_its_rows_order_and_a_finite_distribution(penalty: float) -> None:
    """A penalty that divides a logit past float32's largest (9 / 1e-38): its row was NaN and the step failed. The
    likelier seen token still wins, greedy or drawn (the other is ~7e38 below it); the other rows are unchanged."""
    logits = torch.zeros(2, 10)
    logits[:, 3], logits[:, 5] = 2.0, 9.0  # both seen: 5 the likelier
    greedy = _penalized("g", [3, 5], [], repetition_penalty=penalty)
    plain = _penalized("p", [3, 5], [], repetition_penalty=2.0)
    sampler = Sampler(torch.device("cpu"))
    assert [t.token_id for t in sampler.sample(logits.clone(), [greedy, plain])] == [5, 5]
    drawn = _penalized("d", [3, 5], [], repetition_penalty=penalty)
    drawn = dataclasses.replace(drawn, sampling_params=SamplingParams(temperature=1.0, repetition_penalty=penalty))
    assert {sampler.sample(logits.clone(), [drawn])[0].token_id for _ in range(20)} == {5}
    adjusted = sampler._adjusted(logits.clone(), [greedy, plain], [(0, ()), (1, ())], [], [], [])
    assert torch.isfinite(adjusted[0, 5]) and adjusted[0, 5] == adjusted[0].max()
    assert torch.equal(
        adjusted[1], torch.where(torch.arange(10) == 3, 1.0, torch.where(torch.arange(10) == 5, 4.5, 0.0))
    )


def test_penalties_count_a_request_first_seen_with_outputs_and_then_each_sampled_token() -> None:
    """A request that arrives with outputs (a handoff from a prefill engine) is counted from its history; then the
    sampler counts what it draws, so a repeated token loses more each time."""
    sampler = Sampler(torch.device("cpu"))
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 3.0, 1.0
    drawn = []
    for step in range(4):
        # The history does not grow (as in a multi-step window): the sampler's own counts carry it.
        c = _penalized("r", [1, 2], [4, 4], frequency_penalty=0.6)
        c = dataclasses.replace(c, num_output_tokens=2 + step)
        drawn.append(sampler.sample(logits, [c])[0].token_id)
    # 4 holds 3 - 0.6 * 2 = 1.8 > 1, then 1.2 > 1 once drawn again, then 0.6 < 1: 6 is drawn, and then 6's
    # 1 - 0.6 = 0.4 < 0.6: 4 again.
    assert drawn == [4, 4, 6, 4]
    sampler.forget(["r"])
    assert not sampler._counts


def test_repetition_penalty_covers_the_prompt_and_divides_or_multiplies_by_sign() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.9, -1.2, 0.0]])
    c = _penalized("r", [0, 1], [], repetition_penalty=2.0)
    # 0 (in the prompt) becomes 1.0 < 1.9, so 2 wins; 1 becomes -2.0.
    assert Sampler(torch.device("cpu")).sample(logits.clone(), [c])[0].token_id == 2
    c = _penalized("q", [0, 1], [], repetition_penalty=2.0, logprobs=4)
    out = Sampler(torch.device("cpu")).sample(logits.clone(), [c])[0]
    assert out.token_id == 2 and out.rank == 2  # the raw logprobs: 0 was the likelier before the penalty


def test_a_history_shorter_than_its_outputs_is_an_error_not_a_wrong_count() -> None:
    c = _penalized("r", [1, 2], [4], presence_penalty=1.0)
    c = dataclasses.replace(c, num_output_tokens=3)
    with pytest.raises(RuntimeError, match="3 output tokens, 1 in its history"):
        Sampler(torch.device("cpu")).sample(torch.zeros(1, 10), [c])


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"min_p": 1.01}, "min_p"),
        ({"logit_bias": ((5, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias"),
        ({"logit_bias": ((5, "1"),)}, "logit_bias"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (3, -1)}, "allowed_token_ids"),
        ({"allowed_token_ids": (3, True)}, "allowed_token_ids"),
        ({"bad_words": ("ok", "")}, "bad_words"),
        ({"bad_words": ("ok", 5)}, "bad_words"),
        ({"bad_words": tuple(f"w{i}" for i in range(129))}, "bad_words"),
        ({"bad_words_token_ids": ((3,), ())}, "bad_words"),
        ({"bad_words_token_ids": ((3, -2),)}, "bad_words"),
    ],
)
def test_out_of_range_penalties_and_biases_are_refused(params: dict, param: str) -> None:
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**params)
    assert err.value.param == param


def test_penalties_mark_a_request_penalized_and_logit_bias_takes_a_dict() -> None:
    assert not SamplingParams(logit_bias={5: 1}, min_p=0.2).penalized
    assert SamplingParams(repetition_penalty=1.1).penalized and SamplingParams(presence_penalty=-0.1).penalized
    assert SamplingParams(logit_bias={5: 1}).logit_bias == ((5, 1.0),)
    assert SamplingParams(frequency_penalty=0.5).for_sample(1).penalized


def test_allowed_token_ids_hold_greedy_and_sampled_rows() -> None:
    logits = torch.zeros(3, 30)
    logits[:, 3] = 9.0  # the best token, not allowed
    logits[:, 6] = 1.0  # the best allowed one
    allowed = (5, 6, 7)
    chunks = [
        chunk("g", SamplingParams(temperature=0.0, allowed_token_ids=allowed)),
        chunk("s", SamplingParams(temperature=1.0, allowed_token_ids=allowed)),
        chunk("free", SamplingParams(temperature=0.0)),
    ]
    sampler = Sampler(torch.device("cpu"))
    drawn = set()
    for _ in range(100):
        out = [t.token_id for t in sampler.sample(logits, chunks)]
        assert out[0] == 6 and out[2] == 3
        drawn.add(out[1])
    assert drawn == {5, 6, 7}


def _speculating(params: SamplingParams, outputs: list[int], drafts: tuple[int, ...]) -> list[ScheduledChunk]:
    """A speculating chunk's rows as the runner makes them: one after the request's last token and one after each
    draft, each counting the drafts before it as output."""
    first = ScheduledChunk(
        "spec", [outputs[-1], *drafts], 1, [0], True, params, len(outputs), (2,), history=[1, *outputs],
        num_prompt_tokens=1, draft_token_ids=drafts,
    )  # fmt: skip
    return [dataclasses.replace(first, num_output_tokens=len(outputs) + j) for j in range(len(drafts) + 1)]


def test_every_draft_row_is_masked_after_the_drafts_before_it() -> None:
    """Speculative decoding: each row of a speculating chunk is held to the allowed tokens, and bad words ban a token
    after the output and the drafts before the row (a draft the mask refuses is never kept). Every row's logits
    favour 3 (not allowed), then 5, then 4."""
    logits = torch.zeros(3, 20)
    logits[:, 3], logits[:, 5], logits[:, 4] = 20.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, allowed_token_ids=(2, 4, 5, 6), bad_words_token_ids=((4, 5), (5, 9)))
    sampler = Sampler(torch.device("cpu"))
    rows = _speculating(params, [6], drafts=(4, 5))
    # After 6: 5. After the draft 4: not 5 (the word 4 5), so 4. After the drafts 4 5: 5 again.
    assert [t.token_id for t in sampler.sample(logits, rows)] == [5, 4, 5]
    # The request kept 5 (its first draft rejected). Its next step, in a window whose history has not grown, reads
    # the outputs the sampler kept: after 6 5 the word 5 9 bans 9.
    logits[:, 9] = 30.0
    rows = _speculating(params, [6], drafts=())
    later = dataclasses.replace(rows[0], num_output_tokens=2)
    assert sampler.sample(logits[:1], [later])[0].token_id == 5


def test_a_row_left_no_token_ends_its_request() -> None:
    """Allowed tokens that other masks forbid all (EOS alone, before min_tokens) leave the row nothing to draw (a NaN
    distribution, which failed the step): it takes its request's end token, greedy or drawn, as a grammar's dead end
    does; the other rows are drawn as ever."""
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0
    stuck = {"allowed_token_ids": (2,), "min_tokens": 3}
    chunks = [
        chunk("g", SamplingParams(temperature=0.0, **stuck)),
        chunk("s", SamplingParams(temperature=1.0, **stuck)),
        chunk("free", SamplingParams(temperature=1.0, seed=0)),
    ]
    assert [t.token_id for t in Sampler(torch.device("cpu")).sample(logits, chunks)][:2] == [2, 2]


def test_masked_rows_are_drawn_on_the_host_and_need_history_only_for_words_of_several_tokens() -> None:
    assert not Sampler.draws_alone(chunk("a", SamplingParams(allowed_token_ids=(1, 2))))
    assert not Sampler.draws_alone(chunk("b", SamplingParams(bad_words_token_ids=((5,),))))
    assert not SamplingParams(bad_words_token_ids=((5,), (6,))).needs_history  # (banned everywhere)
    assert SamplingParams(bad_words_token_ids=((5,), (6, 7))).needs_history
    assert SamplingParams(bad_words=["a", "b", "a"], allowed_token_ids=[4, 3]).bad_words == ("a", "b")


def test_a_row_of_nan_logits_does_not_fail_the_draw_of_the_rows_beside_it() -> None:
    """A row whose logits are NaN (a model's or an adapter's numbers gone bad) failed the batch's one multinomial draw,
    every request of the step with it: it now draws token 0, and the rows beside it, shared and seeded, draw from
    their own distributions."""
    logits = torch.full((4, 20), -30.0)
    logits[:, 5] = 0.0
    logits[1] = float("nan")
    logits[3, :] = float("inf")  # (softmax of inf: NaN too)
    chunks = [chunk(f"r{i}", SamplingParams(temperature=0.8, seed=1 if i == 2 else None)) for i in range(4)]
    assert [t.token_id for t in Sampler(torch.device("cpu")).sample(logits, chunks)] == [5, 0, 5, 0]
