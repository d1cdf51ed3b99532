"""Turning logits into tokens: penalties, logit biases and masks (allowed tokens, bad words, early stops, grammars),
greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from boundless.attention.backend import to_device
from boundless.engine.bad_words import banned_tokens, longest_prefix
from boundless.engine.identity_cache import IdentityCache
from boundless.engine.logprobs import SampledToken, score_tokens
from boundless.engine.scheduler import ScheduledChunk
from boundless.engine.speculative import accepted_tokens
from boundless.engine.structured_output import GrammarMatcher, Grammars, grammar_start, mask_logits
from boundless.model import cpu_kernels

_BIASES_KEPT = 64  # logit biases kept on the device for the requests of late (Sampler._bias_of)


@dataclass
class TokenCounts:
    """A penalized request's tokens as its penalties see them: the prompt's distinct ids and how often each output
    token occurs, counted as the sampler draws them (a multi-step window's passes too, which the request's own list
    holds only once the window ends)."""

    prompt: torch.Tensor  # distinct prompt token ids (long)
    output: Counter[int]
    num_output_tokens: int  # how many output tokens are counted

    @classmethod
    def of(cls, chunk: ScheduledChunk, device: torch.device) -> TokenCounts:
        """Counted from the chunk's history (the request's tokens before this step)."""
        output = _outputs(chunk)
        ids = torch.tensor(list(chunk.history[: chunk.num_prompt_tokens]), dtype=torch.long, device=device)
        return cls(torch.unique(ids), Counter(output), len(output))


def _same_chunk(chunks: Sequence[ScheduledChunk], i: int) -> bool:
    """Whether row ``i`` is a later sampling position of the chunk of row ``i - 1`` (speculative decoding)."""
    return i > 0 and chunks[i - 1].request_id == chunks[i].request_id


def _draft_places(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """Each row's place among its chunk's rows (speculative decoding: a speculating chunk has a row per position,
    after its last known token and after each draft); 0 for a chunk's first row, and for every row without drafts."""
    places: list[int] = []
    k = 0
    for i, c in enumerate(chunks):
        k = k + 1 if c.draft_token_ids and _same_chunk(chunks, i) else 0
        places.append(k)
    return places


def _checked_drafts(chunks: Sequence[ScheduledChunk]) -> list[int | None]:
    """Each row's draft, the token its sample is checked against (speculative decoding): a speculating chunk's rows
    check its drafts in turn, its last none (a bonus token); None for a row without drafts."""
    return [
        c.draft_token_ids[k] if k < len(c.draft_token_ids) else None
        for c, k in zip(chunks, _draft_places(chunks), strict=True)
    ]


def _outputs(chunk: ScheduledChunk) -> Sequence[int]:
    """The output tokens the chunk's request had before this step (from its history)."""
    output = chunk.history[chunk.num_prompt_tokens : chunk.num_prompt_tokens + chunk.num_output_tokens]
    if len(output) != chunk.num_output_tokens:
        raise RuntimeError(
            f"request {chunk.request_id}: {chunk.num_output_tokens} output tokens, {len(output)} in its history"
        )
    return output


class Sampler:
    """Samples one token per row; seeded requests own a generator, so their samples do not depend on the batch.
    Penalized requests' token counts (:class:`TokenCounts`) and structured requests' places in their grammars
    (``grammars``, the engine's compiled ones) are kept here between steps, advanced by each token drawn."""

    def __init__(self, device: torch.device, seed: int = 0, grammars: Grammars | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.grammars = grammars
        self._generators: dict[str, torch.Generator] = {}
        # Logit biases on the device, by their params' tuple (a request's samples share it): :meth:`_bias_of`.
        self._biases: IdentityCache[tuple[tuple[int, float], ...], tuple[torch.Tensor, torch.Tensor]] = IdentityCache(
            _BIASES_KEPT
        )
        self._counts: dict[str, TokenCounts] = {}
        self._matchers: dict[str, GrammarMatcher] = {}
        # The outputs drawn so far (a window's passes too, which the history lacks) of requests whose sampling reads
        # them (:meth:`_drawn_before`): a grammar that waits for its start, a thinking budget, bad words.
        self._drawn: dict[str, list[int]] = {}
        # Grammars that begin after given tokens (StructuredOutput.after): where each began in its request's output.
        self._starts: dict[str, int] = {}
        # Requests with a thinking budget (SamplingParams.thinking_budget) whose thinking has closed (nothing more to
        # force).
        self._thought: set[str] = set()
        # Requests with allowed_token_ids: the tokens they may not sample, a mask over the vocabulary made once.
        self._disallowed: dict[str, torch.Tensor] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._counts.pop(rid, None)
            self._matchers.pop(rid, None)
            self._starts.pop(rid, None)
            self._drawn.pop(rid, None)
            self._thought.discard(rid)
            self._disallowed.pop(rid, None)

    def _drawn_before(self, chunk: ScheduledChunk, k: int) -> list[int]:
        """The outputs the request of a row drew before this step, ``k`` being the row's place in its chunk (a later
        row's chunk counts the drafts before it as output); read from the history when not kept up to date here, and
        kept from then on (:meth:`sample` adds the tokens each step keeps)."""
        drawn = self._drawn.get(chunk.request_id)
        if drawn is None or len(drawn) != chunk.num_output_tokens - k:
            drawn = self._drawn[chunk.request_id] = list(_outputs(chunk))
        return drawn

    def _waits(self, chunk: ScheduledChunk) -> bool:
        """Whether the request's grammar has yet to begin: its ``after`` tokens are not in its output so far."""
        spec = chunk.sampling_params.structured
        rid = chunk.request_id
        if spec is None or not spec.after or rid in self._starts:
            return False
        start = grammar_start(self._drawn_before(chunk, 0), spec.after, spec.after_close)
        if start is None:
            return True
        self._starts[rid] = start
        return False

    def _matcher(self, chunk: ScheduledChunk) -> GrammarMatcher:
        """The request's matcher, made (and given the outputs it already has since its grammar began) when first
        seen."""
        rid = chunk.request_id
        matcher = self._matchers.get(rid)
        start = self._starts.get(rid, 0)
        # (A matcher that took its end token stays: a window's passes after it draw tokens that are discarded.)
        if matcher is None or (matcher.num_tokens + start != chunk.num_output_tokens and not matcher.done):
            spec = chunk.sampling_params.structured
            if self.grammars is None or spec is None:
                raise RuntimeError("a structured request reached a sampler without grammars")
            drawn = self._drawn.get(rid)
            outputs = drawn if drawn is not None and len(drawn) == chunk.num_output_tokens else _outputs(chunk)
            matcher = self.grammars.matcher(spec)
            matcher.replay(outputs[start:])
            self._matchers[rid] = matcher
        return matcher

    def _forced_ends(self, chunks: Sequence[ScheduledChunk], places: list[int]) -> list[tuple[int, int]]:
        """The rows whose request has spent its thinking budget, each with the token it must take: its thinking's end
        tag, a token at a time (``engine/thinking_budget.py``). A request whose grammar holds its thinking too
        (``--structured-outputs-in-reasoning``) is left to the grammar."""
        forced = []
        for i, (c, k) in enumerate(zip(chunks, places, strict=True)):
            p = c.sampling_params
            budget, rid = p.thinking_budget, c.request_id
            if budget is None or rid in self._thought or (p.structured is not None and not p.structured.after):
                continue
            drawn = self._drawn_before(c, k)
            if budget.within(len(drawn) + k):
                continue  # (the common step: nothing read but the count)
            outputs = [*drawn, *c.draft_token_ids[:k]] if k else drawn
            token = budget.forced(outputs)
            if token is not None:
                forced.append((i, token))
            elif not k:
                self._thought.add(rid)  # past the budget and free: closed, or never thinking
        return forced

    def _banned_words(self, chunks: Sequence[ScheduledChunk], places: list[int]) -> list[tuple[int, int]]:
        """The rows' tokens that bad words ban (row, token): the last of each word's tokens where those before it end
        the output (``engine/bad_words.py``); a speculating chunk's later rows count the drafts before them."""
        banned = []
        for i, (c, k) in enumerate(zip(chunks, places, strict=True)):
            words = c.sampling_params.bad_words_token_ids
            if not words:
                continue
            keep = longest_prefix(words)  # (0: words of one token, banned whatever came before)
            recent = [*self._drawn_before(c, k)[-keep:], *c.draft_token_ids[:k]][-keep:] if keep else ()
            banned += [(i, token) for token in banned_tokens(words, recent)]
        return banned

    def _disallowed_mask(self, chunk: ScheduledChunk, vocab: int, device: torch.device) -> torch.Tensor:
        """The request's mask of the tokens ``allowed_token_ids`` leaves out (True: not allowed), made when first
        seen."""
        mask = self._disallowed.get(chunk.request_id)
        if mask is None:
            mask = torch.ones(vocab, dtype=torch.bool)
            mask[list(chunk.sampling_params.allowed_token_ids or ())] = False
            mask = self._disallowed[chunk.request_id] = to_device(mask, device)
        return mask

    def _generator_for(self, chunk: ScheduledChunk) -> torch.Generator:
        seed = chunk.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._generators.get(chunk.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[chunk.request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
        """``logits`` [rows, vocab] in fp32, one row per chunk."""
        raw_logprobs = None
        if any(c.sampling_params.logprobs is not None for c in chunks):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        # Penalized rows, each with the drafts before it in its chunk (speculative decoding: counted as outputs).
        places = _draft_places(chunks)
        penalized = [
            (i, c.draft_token_ids[:k])
            for i, (c, k) in enumerate(zip(chunks, places, strict=True))
            if c.sampling_params.penalized
        ]
        # Structured requests' first rows, with their matchers and drafts (speculative decoding: a row per position
        # of the chunk follows); one whose output is complete (a window's pass past its EOS, whose token is
        # discarded) is left alone.
        structured = []
        for i, c in enumerate(chunks):
            if c.sampling_params.structured is None or (c.draft_token_ids and _same_chunk(chunks, i)):
                continue
            if self._waits(c):  # free until its grammar begins (a reasoning model's thinking)
                continue
            matcher = self._matcher(c)
            if not matcher.done:
                structured.append((i, matcher, c.draft_token_ids))
        forced = self._forced_ends(chunks, places)
        word_bans = self._banned_words(chunks, places)
        tokens = self.draw(self._adjusted(logits, chunks, penalized, structured, forced, word_bans), chunks)
        token_list = tokens.tolist()

        def kept(i: int, drafts: tuple[int, ...]) -> list[int]:
            """The tokens the request whose first row is ``i`` keeps: its sample, or a speculating one's up to its
            first rejected draft (as ``runner.sample`` keeps them)."""
            samples = token_list[i : i + len(drafts) + 1]
            return samples[: accepted_tokens(samples, drafts)]

        for i, before in penalized:
            if before:
                continue  # a later position of a speculating chunk: its tokens are counted with the chunk's first
            counts = self._counts[chunks[i].request_id]
            for token in kept(i, chunks[i].draft_token_ids):
                counts.output[token] += 1
                counts.num_output_tokens += 1
        for i, matcher, drafts in structured:
            for token in kept(i, drafts):
                if matcher.done:
                    break  # a kept draft was the end token
                matcher.accept(token)
        if self._drawn:  # (the outputs of requests whose sampling reads them, as drawn)
            for i, (c, k) in enumerate(zip(chunks, places, strict=True)):
                if not k and c.request_id in self._drawn:
                    self._drawn[c.request_id] += kept(i, c.draft_token_ids)
        out = [SampledToken(t) for t in token_list]
        if raw_logprobs is not None:
            self._fill_logprobs(raw_logprobs, tokens, chunks, out)
        return out

    @staticmethod
    def draws_alone(chunk: ScheduledChunk) -> bool:
        """Whether the chunk's next tokens depend on its logits (and its generator) alone: no penalties, grammar,
        logit biases, allowed tokens, bad words, logprobs, drafts, or stop tokens still forbidden (``min_tokens``). A
        multi-step window of such chunks may draw each pass's tokens on the device with no host work between passes
        (``DecodeGraphs.launch_window``): :meth:`draw` is all of their sampling."""
        p = chunk.sampling_params
        return (
            p.logprobs is None
            and not p.needs_history
            and not p.logit_bias
            and p.allowed_token_ids is None
            and not p.bad_words_token_ids
            and chunk.num_output_tokens >= p.min_tokens
            and not chunk.draft_token_ids
        )

    def draw(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """A token id per row of ``logits`` (adjusted already): greedy rows their argmax, the others a draw from their
        filtered distribution."""
        return self.draw_planned(logits, self.plan_draw(chunks, logits.device, logits.shape[-1]))

    def plan_draw(self, chunks: Sequence[ScheduledChunk], device: torch.device, vocab: int) -> DrawPlan:
        """What drawing tokens for these rows needs, made once: a window's passes draw for the same rows with no copy
        from the host between them (each would wait for the device)."""
        greedy = [i for i, c in enumerate(chunks) if c.sampling_params.greedy]
        if len(greedy) == len(chunks):
            return DrawPlan(len(chunks))
        random_rows = [i for i, c in enumerate(chunks) if not c.sampling_params.greedy]
        params = [chunks[i].sampling_params for i in random_rows]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        shared = [j for j, p in enumerate(params) if p.seed is None]
        checks = _checked_drafts(chunks)

        # (Copied in stream order: a window planned while the last one runs does not wait for it.)
        def rows(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.long), device)

        def column(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values), device).unsqueeze(1)

        return DrawPlan(
            num_rows=len(chunks),
            greedy=rows(greedy) if greedy else None,
            random=rows(random_rows),
            temperatures=column([p.temperature for p in params]),
            min_ps=column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            top_ks=rows(top_ks).unsqueeze(1) if any(k < vocab for k in top_ks) else None,
            top_ps=column([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
            shared=(rows(shared), rows([random_rows[j] for j in shared])) if shared else None,
            all_shared=len(shared) == len(random_rows),
            seeded=[(j, random_rows[j], self._generator_for(chunks[random_rows[j]]), checks[random_rows[j]])
                    for j, p in enumerate(params) if p.seed is not None],
        )  # fmt: skip

    def draw_planned(self, logits: torch.Tensor, plan: DrawPlan) -> torch.Tensor:
        """:meth:`draw` with its plan made: nothing copied from the host, so nothing waits for the device. ``logits``
        may be in the model's dtype (a CUDA graph's): greedy rows take their argmax as they are, drawing rows in
        fp32."""
        if plan.random is None:  # the common case: no copy of the logits rows
            return cpu_kernels.argmax_rows(logits)
        tokens = torch.empty(plan.num_rows, dtype=torch.long, device=logits.device)
        if plan.greedy is not None:
            tokens[plan.greedy] = cpu_kernels.argmax_rows(logits[plan.greedy])
        probs = _filtered_probs(logits[plan.random].float(), plan)
        # The rows of requests without a seed draw together from the shared generator, in one launch (a launch per
        # row was a GPU step's longest host loop); a seeded request draws from its own generator, its stream
        # independent of the batch it is in.
        if plan.shared is not None:
            among, rows = plan.shared
            drawn = torch.multinomial(probs if plan.all_shared else probs[among], 1, generator=self.generator)
            tokens[rows] = drawn.squeeze(1)
        # A speculating seeded request draws its rows in order and none after the first that rejects its draft (their
        # tokens are dropped): its generator then takes a draw per kept token, as without drafts, so its samples are
        # those of the same request unspeculated, whatever was drafted.
        rejected: set[int] = set()
        for j, i, generator, draft in plan.seeded:
            if id(generator) in rejected:
                tokens[i] = 0  # (a row after the rejection: dropped)
                continue
            tokens[i] = torch.multinomial(probs[j], 1, generator=generator)[0]
            if draft is not None and int(tokens[i]) != draft:
                rejected.add(id(generator))
        return tokens

    def _adjusted(
        self,
        logits: torch.Tensor,
        chunks: Sequence[ScheduledChunk],
        penalized: list[tuple[int, tuple[int, ...]]],
        structured: list[tuple[int, GrammarMatcher, tuple[int, ...]]],
        forced: list[tuple[int, int]],
        word_bans: list[tuple[int, int]],
    ) -> torch.Tensor:
        """The logits to sample from: tokens outside ``allowed_token_ids`` forbidden, logit biases added, then
        penalties (vLLM's order), early stops, the tokens bad words ban (``word_bans``: row, token) and those the
        grammar does not allow forbidden, and ``forced`` rows (row, token) held to their token. A copy if any of them
        applies to a row. A row left with no token (a grammar's dead end; allowed tokens all forbidden; a grammar's
        tokens all banned by bad words) is held to its request's end token: a request that can take nothing ends (a
        row of no token fails to draw, and with it the step)."""
        banned_rows, banned_ids = [row for row, _ in word_bans], [token for _, token in word_bans]
        allowed_rows: list[int] = []
        biased: dict[int, tuple[tuple[tuple[int, float], ...], list[int]]] = {}  # each bias's rows
        for i, c in enumerate(chunks):
            p = c.sampling_params
            if p.allowed_token_ids is not None:
                allowed_rows.append(i)
            if c.num_output_tokens < p.min_tokens:  # forbid EOS and stop tokens before min_tokens
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(c.eos_token_ids)
                banned_rows.extend([i] * len(banned))
                banned_ids.extend(banned)
            if p.logit_bias:
                biased.setdefault(id(p.logit_bias), (p.logit_bias, []))[1].append(i)
        if not (banned_rows or biased or allowed_rows or penalized or structured or forced):
            return logits
        logits = logits.clone()
        device = logits.device
        if allowed_rows:
            allowed_index = torch.tensor(allowed_rows, device=device)
            masks = [self._disallowed_mask(chunks[i], logits.shape[-1], device) for i in allowed_rows]
            logits[allowed_index] = logits[allowed_index].masked_fill(torch.stack(masks), float("-inf"))
        for bias, bias_rows in biased.values():  # (the rows that share a bias: one add over all of them)
            ids, values = self._bias_of(bias, device)
            logits[torch.tensor(bias_rows, device=device).unsqueeze(1), ids.unsqueeze(0)] += values.to(logits.dtype)
        if penalized:
            self._penalize(logits, chunks, penalized)
        if banned_rows:
            logits[torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device)] = float("-inf")
        dead_ends: list[int] = []
        if structured:
            # A grammar at a dead end allows nothing: the request's end token ends it alone (GrammarMatcher).
            grammar_rows, matchers, drafts = zip(*structured, strict=True)
            dead_ends += mask_logits(logits, list(grammar_rows), list(matchers), drafts)
        # Rows whose masks together leave no token: allowed tokens all forbidden (by min_tokens, bad words or a
        # grammar), or a grammar's every token banned by bad words (a vocabulary less a few banned tokens is never
        # empty). A grammar's is a dead end it is told of, so that it takes the end token.
        places = {first + k: (m, k) for first, m, d in structured for k in range(len(d) + 1)}
        masked = sorted({*allowed_rows, *(row for row in banned_rows if row in places)})
        if masked:
            empty = torch.isneginf(logits[torch.tensor(masked, device=device)]).all(dim=-1).nonzero().flatten()
            empty_rows = [masked[j] for j in empty.tolist()]
            dead_ends += empty_rows
            for row in empty_rows:
                if row in places:
                    matcher, k = places[row]
                    matcher.allowed_nothing(k)
        held = {row for row, _ in forced}
        for row in dict.fromkeys(r for r in dead_ends if r not in held):
            forced = [*forced, (row, chunks[row].eos_token_ids[0] if chunks[row].eos_token_ids else 0)]
        if forced:
            rows, ids = (torch.tensor(column, device=device) for column in zip(*forced, strict=True))
            logits[rows] = float("-inf")
            logits[rows, ids] = 0.0
        return logits

    def _bias_of(self, bias: tuple[tuple[int, float], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A logit bias's token ids and values on the device, made once for the params that share it (a request's
        samples share the tuple) and kept while it is in use: rebuilt from Python every step, a whole vocabulary's
        bias on 128 samples took seconds a step, every request of the step waiting."""

        def made(pairs: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
            ids = to_device(torch.tensor([token for token, _ in pairs], dtype=torch.long), device)
            return ids, to_device(torch.tensor([value for _, value in pairs], dtype=torch.float32), device)

        return self._biases.get(bias, made)

    def _penalize(
        self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk], penalized: list[tuple[int, tuple[int, ...]]]
    ) -> None:
        """Apply the rows' penalties in place, all rows at once (as vLLM does, with dense per-row masks and counts;
        a few host-to-device copies a step, not a few per row): repetition over the prompt's and the output's
        tokens, then frequency and presence over the output's. A speculating chunk's later rows count the drafts
        before them as output."""
        device, vocab = logits.device, logits.shape[-1]
        rows = [i for i, _ in penalized]
        prompts: list[torch.Tensor] = []
        out_rows: list[int] = []
        out_ids: list[int] = []
        out_times: list[int] = []
        for j, (i, before) in enumerate(penalized):
            c = chunks[i - len(before)]  # the chunk's first row: the request's tokens before the step
            counts = self._counts.get(c.request_id)
            if counts is None or counts.num_output_tokens != c.num_output_tokens:
                counts = self._counts[c.request_id] = TokenCounts.of(c, device)
            output = counts.output + Counter(before) if before else counts.output
            prompts.append(counts.prompt)
            out_rows.extend([j] * len(output))
            out_ids.extend(output)
            out_times.extend(output.values())
        params = [chunks[i].sampling_params for i in rows]
        index = torch.tensor(rows, device=device)
        picked = logits[index]
        times = torch.zeros(len(rows), vocab, dtype=logits.dtype, device=device)
        times[
            torch.tensor(out_rows, dtype=torch.long, device=device),
            torch.tensor(out_ids, dtype=torch.long, device=device),
        ] = torch.tensor(out_times, dtype=logits.dtype, device=device)
        seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = times > 0
            prompt_rows = torch.repeat_interleave(
                torch.arange(len(rows), device=device), torch.tensor([len(t) for t in prompts], device=device)
            )
            seen[prompt_rows, torch.cat(prompts)] = True

        def penalties_applied(dtype: torch.dtype) -> torch.Tensor:
            row = picked.to(dtype)
            if seen is not None:
                penalty = torch.tensor([p.repetition_penalty for p in params], dtype=dtype, device=device).unsqueeze(1)
                if dtype == torch.float64:
                    # A penalty so small that a logit over it passes even float64's range (5e-324, the least double,
                    # made an infinite logit, and inf - inf a NaN row: the step failed) is taken as the least that
                    # keeps the row in range: the seen logits' order holds, their gaps still past float32's range.
                    largest = torch.where(torch.isfinite(row), row.abs(), 0.0).amax(dim=-1, keepdim=True)
                    penalty = torch.maximum(penalty, largest / (torch.finfo(dtype).max / 4))
                row = torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row)
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=device)
            presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=device)
            return row - frequency.unsqueeze(1) * times - presence.unsqueeze(1) * (times > 0)

        result = penalties_applied(logits.dtype)
        if seen is not None and any(p.repetition_penalty < 1.0 for p in params):
            # A tiny repetition penalty (1e-38 is in its range) divides a logit past float32's largest, and an
            # infinite logit makes the row's distribution NaN (the step failed, every request of it). Such rows are
            # made again in float64 (up to ~1e308), less the row's largest: a shift changes no draw and no argmax,
            # and what falls below float32's range has a probability of 0 there too. Other rows are unchanged. (Only
            # a penalty under 1 divides a logit up: with none, nothing is made twice.)
            wide = penalties_applied(torch.float64)
            wide = wide - wide.max(dim=-1, keepdim=True).values
            # What falls below float32's range stays finite, at -1e30, not -inf: a grammar masked after this may
            # forbid every other token (the seen ones), and a row of -inf is NaN (the step failed). -1e30 is no
            # probability beside a token at 0, and stays finite over any temperature down to 1e-8. -inf stays -inf.
            wide = torch.where(wide == float("-inf"), wide, wide.clamp_min(-1e30)).to(logits.dtype)
            result = torch.where(torch.isfinite(result).all(dim=-1, keepdim=True), result, wide)
        logits[index] = result

    @staticmethod
    def _fill_logprobs(
        logprobs: torch.Tensor, tokens: torch.Tensor, chunks: Sequence[ScheduledChunk], out: list[SampledToken]
    ) -> None:
        rows = [i for i, c in enumerate(chunks) if c.sampling_params.logprobs is not None]
        idx = torch.tensor(rows, device=logprobs.device)
        top_ks = [chunks[i].sampling_params.logprobs or 0 for i in rows]
        for i, token in zip(rows, score_tokens(logprobs[idx], tokens[idx], top_ks), strict=True):
            out[i] = token


@dataclass
class DrawPlan:
    """What :meth:`Sampler.draw_planned` needs of a set of rows, on their device: which rows are greedy and which
    draw (``random``: None when all are greedy), the drawing rows' temperatures and filters (each None where no row
    uses it), and which of them draw from the shared generator (their places among the drawing rows, and their rows)
    or from their own (seeded: place, row, generator, and the draft the row's sample is checked against, if any)."""

    num_rows: int
    greedy: torch.Tensor | None = None
    random: torch.Tensor | None = None
    temperatures: torch.Tensor | None = None
    min_ps: torch.Tensor | None = None
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    all_shared: bool = False
    seeded: list[tuple[int, int, torch.Generator, int | None]] = field(default_factory=list)


def _filtered_probs(logits: torch.Tensor, plan: DrawPlan) -> torch.Tensor:
    """The drawing rows' distributions: temperature, then min-p, top-k and top-p where a row asks for them."""
    assert plan.temperatures is not None
    logits = logits / plan.temperatures
    if plan.min_ps is not None:
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * plan.min_ps
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if plan.top_ks is not None:
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, plan.top_ks - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if plan.top_ps is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p (the top one always stays).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= plan.top_ps
        drop[:, 0] = False
        mask = torch.zeros_like(drop).scatter_(1, order, drop)
        logits = logits.masked_fill(mask, float("-inf"))
    probs = logits.softmax(dim=-1)
    # A row whose logits are not finite (NaN from a model's or an adapter's numbers) has no distribution, and the
    # batch's one draw would fail for every row in it: such a row draws token 0, the others as they are (vLLM's
    # sampler does not fail either). Without a host sync: a GPU step stays queued.
    probs = probs.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    probs[:, 0] += probs.sum(dim=-1) <= 0
    return probs
