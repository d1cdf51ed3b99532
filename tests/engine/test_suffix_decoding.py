"""Suffix decoding (``--speculative-config '{"method": "suffix"}'``): the proposer against a brute-force reading of
Arctic Inference's suffix trees, its cache of outputs, and the real engine drafting a call from an earlier call's
answer."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest

from boundless.config import ConfigError, SchedulerConfig, SpeculativeConfig
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.suffix_decoding import MIN_MATCH, SuffixProposer
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel


def _proposer(**spec: object) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig.parse(json.dumps({"method": "suffix", **spec})))


Written = list[list[int]]  # when each token of each sequence was written (the proposer's call that took it)


def _occurrences(seqs: Sequence[Sequence[int]], s: Sequence[int], written: Written) -> list[tuple[int, int]]:
    """Where ``s`` ends in each sequence, as (sequence, position), the latest written first."""
    n = len(s)
    found = [(i, j + n - 1) for i, seq in enumerate(seqs) for j in range(len(seq) - n + 1) if list(seq[j : j + n]) == s]
    return sorted(found, key=lambda at: (written[at[0]][at[1]], at[1]), reverse=True)


def _tree_draft(
    seqs: Sequence[Sequence[int]], written: Written, pattern: list[int], k: int, depth: int, factor: float, p0: float
) -> tuple[float, list[int]]:
    """Arctic's ``SuffixTree.speculate`` over a tree of every suffix of ``seqs`` cut at ``depth``, a node's count
    being the occurrences of its path: for each match length from ``MIN_MATCH`` on (while the pattern's last ``m``
    tokens occur), a walk to the child of the largest count (on a tie, the one whose occurrence was written latest;
    Arctic leaves ties to its hash map's order) while the probability stays at least ``p0``. -> (score, draft)."""
    best: tuple[float, list[int]] = (0.0, [])
    for m in range(MIN_MATCH, len(pattern)):
        path = pattern[-m:]
        if not _occurrences(seqs, path, written):
            break
        most = min(k, int(m * factor + 1e-6), depth - m)
        prob, score, draft = 1.0, 0.0, []
        while len(draft) < most:
            here = _occurrences(seqs, path, written)
            children: dict[int, list[tuple[int, int]]] = {}
            for i, end in here:
                if end + 1 < len(seqs[i]):
                    children.setdefault(seqs[i][end + 1], []).append((i, end + 1))
            if not children:
                break
            first = {t: here.index((i, end - 1)) for t, ((i, end), *_) in children.items()}  # its latest occurrence
            token = max(children, key=lambda t: (len(children[t]), -first[t]))
            p = prob * len(children[token]) / len(here)
            if p < p0:
                break
            prob, score = p, score + p
            draft.append(token)
            path = path + [token]
        if score >= best[0]:
            best = (score, draft)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_drafts_are_those_of_arctics_suffix_trees(seed: int) -> None:
    """Requests over a small vocabulary (many repeats) start, grow and finish at random, their outputs mostly one
    script (as an agent's calls repeat each other); every proposal equals the reference's best over the request's
    own tokens and over the cached outputs (the last ones, running included)."""
    rng = random.Random(seed)
    depth = rng.choice([6, 8, 24])
    factor, min_prob = rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.5])
    cached = rng.choice([0, 2, 5])
    script = [rng.randrange(4) for _ in range(40)]
    p = _proposer(
        num_speculative_tokens=rng.choice([3, 8]),
        suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_spec_factor=factor,
        suffix_decoding_min_token_prob=min_prob,
        suffix_decoding_max_cached_requests=cached,
    )
    outputs: list[tuple[str, list[int], int]] = []  # (id, tokens, prompt length), in order of their first proposal
    written: dict[str, list[int]] = {}  # each output token's step, once the proposer took it
    running: dict[str, tuple[list[int], int]] = {}
    proposals = nonempty = from_outputs = 0
    for step in range(160):
        if len(running) < 3 and rng.random() < 0.3:
            rid = f"r{step}"
            prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            running[rid] = (prompt, len(prompt))
        if not running:
            continue
        rid = rng.choice(sorted(running))
        tokens, n = running[rid]
        tokens.append(script[len(tokens) - n] if rng.random() < 0.7 else rng.randrange(4))
        if rid not in written:
            outputs.append((rid, tokens, n))
            written[rid] = []
        written[rid] += [step] * (len(tokens) - n - len(written[rid]))  # the proposer takes them at this call
        if rng.random() < 0.1 or len(tokens) > 40:
            p.finish(rid, tokens, n)
            del running[rid]
            continue
        limit = rng.randrange(0, 10)
        got = p.propose(rid, tokens, n, limit)
        k = min(limit, p.num_speculative_tokens)
        pattern = tokens[-depth:]
        own = _tree_draft([tokens], [list(range(len(tokens)))], pattern, k, depth, factor, min_prob)
        last = outputs[-cached:] if cached else []
        other = _tree_draft(
            [t[m:] for _, t, m in last], [written[r] for r, _, _ in last], pattern, k, depth, factor, min_prob
        )
        want = other[1] if other[0] > own[0] else own[1]
        if k <= 0 or len(pattern) <= MIN_MATCH:
            want = []
        assert got == want, (step, rid, tokens, got, own, other)
        proposals += 1
        nonempty += bool(got)
        from_outputs += bool(got) and other[0] > own[0]
    assert proposals > 50 and nonempty > 10
    if cached:
        assert from_outputs > 0
    assert p.cached_outputs == min(cached, len(outputs))


def test_a_call_is_drafted_from_an_earlier_calls_output() -> None:
    p = _proposer()
    answer = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
    p.propose("a", [1, 2, 3, 7] + answer, 4, 8)
    p.finish("a", [1, 2, 3, 7] + answer + [2], 4)  # the tokens of its last step are cached at its end
    # Another prompt, whose output begins as the first one's did: the rest of that output is proposed.
    assert p.propose("b", [9, 9, 8] + answer[:4], 3, 8) == answer[4:8]
    # A match of m tokens proposes at most m * max_spec_factor.
    assert p.propose("c", [9, 9, 8] + answer[:3], 3, 8) == answer[3:6]
    assert p.propose("d", [9, 9, 8] + answer[-3:], 3, 8) == [2]  # the last step's token
    # Without the cache of outputs, only the request's own tokens.
    assert _proposer(suffix_decoding_max_cached_requests=0).propose("b", [9, 9, 8] + answer[:4], 3, 8) == []


def test_the_oldest_outputs_are_evicted_and_the_index_rebuilt() -> None:
    p = _proposer(suffix_decoding_max_cached_requests=3)
    outputs = [[1000 * i + j for j in range(600)] for i in range(1, 6)]
    for i, out in enumerate(outputs):
        p.propose(f"r{i}", [0] + out, 1, 4)
        p.finish(f"r{i}", [0] + out, 1)
    assert p.cached_outputs == 3
    # A running request takes a place too (its output is cached as it is written): "y" evicts r2.
    assert p.propose("y", [7, 7] + outputs[4][:5], 2, 4) == outputs[4][5:9]
    assert p.propose("x", [7, 7] + outputs[0][:5], 2, 4) == []  # evicted long ago
    assert p.cached_outputs == 3
    # The index was rebuilt once evictions left it mostly stale: it holds the live outputs' windows.
    assert sum(len(v) for v in p._index.values()) <= 2 * 600 + 10


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"prompt_lookup_min": 2}, "['prompt_lookup_min'] do not apply to method 'suffix'"),
        ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an integer >= 1"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be an integer >= 0"),
        ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor must be a number >= 0"),
        ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be a number >= 0 and <= 1"),
        ({"suffix_decoding_min_token_prob": "0.1"}, "suffix_decoding_min_token_prob must be a number"),
    ],
)
def test_a_bad_config_names_what_is_wrong(spec: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SchedulerConfig(speculative_config=json.dumps({"method": "suffix", **spec}))
    assert message in str(e.value)
    with pytest.raises(ConfigError, match="do not apply to method 'ngram'"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 4}')


def test_vllms_defaults() -> None:
    config = SpeculativeConfig.parse('{"method": "suffix"}')
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth) == (24, 24)  # the depth
    assert config.suffix_decoding_max_cached_requests == 10_000
    assert (config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (1.0, 0.1)
    config = SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 32}')
    assert config.num_speculative_tokens == 32
    config = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 5, "disable_by_batch_size": 4}')
    assert (config.num_speculative_tokens, config.disable_by_batch_size) == (5, 4)


def test_an_engine_drafts_a_repeated_call_from_the_first_ones_answer(tiny_llama: LoadedModel) -> None:
    """A second call with the same prompt (an agent retrying, or asking again): the first call's output, cached,
    drafts nearly all of the second's, and the tokens are plain decoding's."""
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": 8})
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    def answer(core: EngineCore, rid: str) -> tuple[list[int], int]:
        core.add_request(rid, prompt, params)
        tokens, steps = [], 0
        while core.has_unfinished():
            for delta in core.step():
                tokens += delta.new_token_ids
                steps += 1
        return tokens, steps

    plain = answer(EngineCore.from_model(tiny_llama, engine_config("m", max_model_len=256, policy="fcfs")), "p")
    core = EngineCore.from_model(
        tiny_llama, engine_config("m", max_model_len=256, policy="fcfs", speculative_config=spec)
    )
    first = answer(core, "a")
    before = core.stats()
    second = answer(core, "b")
    after = core.stats()
    assert first[0] == second[0] == plain[0]
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    assert accepted >= 36 and accepted == drafted  # the whole answer but its first tokens, all kept
    assert second[1] <= 12 < first[1]  # tokens come up to 9 a step
