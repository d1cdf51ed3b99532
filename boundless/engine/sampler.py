"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from boundless.engine.scheduler import ScheduledChunk
from boundless.model import cpu_kernels


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the sampled token under the model's raw distribution
    rank: int | None = None  # 1 = the most likely token
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """Samples one token per row; seeded requests own a generator, so their samples do not depend on the batch."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

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
        logits = self._mask_early_stops(logits, chunks)
        greedy = [i for i, c in enumerate(chunks) if c.sampling_params.greedy]
        if len(greedy) == len(chunks):  # the common case: no copy of the logits rows
            tokens = cpu_kernels.argmax_rows(logits)
        else:
            tokens = torch.empty(len(chunks), dtype=torch.long, device=logits.device)
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                tokens[idx] = cpu_kernels.argmax_rows(logits[idx])
        random_rows = [i for i, c in enumerate(chunks) if not c.sampling_params.greedy]
        if random_rows:
            probs = self._filtered_probs(logits[random_rows], [chunks[i] for i in random_rows])
            for j, i in enumerate(random_rows):
                tokens[i] = torch.multinomial(probs[j], 1, generator=self._generator_for(chunks[i]))[0]
        token_list = tokens.tolist()
        out = [SampledToken(t) for t in token_list]
        if raw_logprobs is not None:
            self._fill_logprobs(raw_logprobs, tokens, chunks, out)
        return out

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Forbid EOS and stop tokens for requests that have not reached ``min_tokens``."""
        rows, cols = [], []
        for i, c in enumerate(chunks):
            p = c.sampling_params
            if c.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(c.eos_token_ids)
                rows.extend([i] * len(banned))
                cols.extend(banned)
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
        return logits

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        temps = torch.tensor([c.sampling_params.temperature for c in chunks], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
        top_ks = [c.sampling_params.top_k for c in chunks]
        if any(0 < k < vocab for k in top_ks):
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (ks - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = torch.tensor([c.sampling_params.top_p for c in chunks], device=logits.device)
        if bool((top_ps < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the tokens strictly more likely already reach top_p (the top one always stays).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps.unsqueeze(1)
            drop[:, 0] = False
            mask = torch.zeros_like(drop).scatter_(1, order, drop)
            logits = logits.masked_fill(mask, float("-inf"))
        return logits.softmax(dim=-1)

    @staticmethod
    def _fill_logprobs(
        logprobs: torch.Tensor, tokens: torch.Tensor, chunks: Sequence[ScheduledChunk], out: list[SampledToken]
    ) -> None:
        rows = [i for i, c in enumerate(chunks) if c.sampling_params.logprobs is not None]
        idx = torch.tensor(rows, device=logprobs.device)
        lp = logprobs[idx]
        chosen = lp.gather(1, tokens[idx].unsqueeze(1))
        ranks = (lp > chosen).sum(dim=1) + 1
        k = max(chunks[i].sampling_params.logprobs or 0 for i in rows)
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
        top_vals_l = top_vals.tolist() if top_vals is not None else None
        top_ids_l = top_ids.tolist() if top_ids is not None else None
        for j, i in enumerate(rows):
            out[i].logprob = chosen_l[j]
            out[i].rank = ranks_l[j]
            n = chunks[i].sampling_params.logprobs or 0
            if n and top_ids_l is not None and top_vals_l is not None:
                out[i].top_logprobs = list(zip(top_ids_l[j][:n], top_vals_l[j][:n], strict=True))
