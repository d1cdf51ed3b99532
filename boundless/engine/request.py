"""One generation as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from boundless.engine.handoff import HandoffPlan, PrefixPush
from boundless.engine.logprobs import PromptLogprobs
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.ref import ProgramRef


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV; will be recomputed
    SWAPPED = "swapped"  # its KV waits in host memory
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_HANDED_OFF = "handoff"  # prefilled here; decodes on another instance (engine/handoff.py)


@dataclass(eq=False)
class Request:
    """A sequence being generated.

    Progress is one counter: ``num_computed_tokens`` of ``num_tokens`` have KV in the cache.
    Prefill, chunked prefill, prefix-cache hits, recompute after preemption and decode all follow
    from it: each step computes some of the tokens not yet computed.

    A request is equal only to itself (``eq=False``): the scheduler's queues find and remove requests by ``in``,
    ``remove`` and ``index``, which compared every field of each request passed over (its token lists among them).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    program: ProgramRef | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    # Predicted Outputs (``SamplingParams.prediction``): its drafts kept and rejected so far.
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    service_s: float = 0.0  # model execution time spent on this request (attained service)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None
    # Prefill/decode disaggregation (engine/handoff.py). A PE's request: where its KV goes after its prefill.
    handoff: HandoffPlan | None = None
    handoff_sent: bool = False
    # A DE's request: held back until its first token comes from the PE; under DE-read, its prefix to push.
    awaiting_resume: bool = False
    push: PrefixPush | None = None
    # Prompt logprobs (``SamplingParams.prompt_logprobs``): the prompt's tokens scored so far, in order (the first:
    # None), until the delta of the first sampled token takes them; None when not asked for, taken, or scored by
    # another engine (a resumed request's, a decode engine's: the prefill engine scores the prompt).
    prompt_logprobs: PromptLogprobs | None = None
    # An embedding request of a model that pools every prompt token (mean pooling, ``model/pooling.py``): every
    # position's hidden state is needed, so it takes no cached prefix.
    pools_every_token: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.all_token_ids.extend(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether it takes no cached prefix (it still names its blocks for others): prompt tokens remain to score
        (every prompt position's logits are needed: vLLM's rule), or it pools every prompt token's hidden state."""
        return self.pools_every_token or (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def prompt_targets(self, start: int, end: int) -> tuple[list[int], int]:
        """The prompt tokens a chunk of positions ``start`` to ``end`` (exclusive) scores that are not scored yet, and
        the index of the first: position ``p``'s logits predict token ``p + 1``, so a chunk's last position scores the
        next chunk's first token, and the prompt's last position (it samples) scores none."""
        scored = self.prompt_logprobs
        last = min(end, self.num_prompt_tokens - 1)
        if scored is None or start + 1 > last:
            return [], 0
        if start + 1 > len(scored):  # never: a request that scores its prompt computes every position
            raise RuntimeError(f"request {self.request_id}: prompt token {len(scored)} would be skipped unscored")
        first = max(start + 1, len(scored))  # (recomputed after a preemption: the tokens scored before are skipped)
        if first > last:
            return [], 0
        return self.prompt_token_ids[first : last + 1], first

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the caller's cap, and never past the context length."""
        room = self.max_model_len - self.num_prompt_tokens
        cap = self.sampling_params.max_tokens
        return room if cap is None else min(cap, room)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_outputs(self, token_ids: list[int]) -> tuple[int, RequestStatus | None]:
        """Append a multi-step window's sampled tokens in turn up to the first that finishes the request: how many
        were kept, and the finished status (None: it goes on). What :meth:`append_output` then :meth:`check_stop`
        on each token gives, in one pass (the engine's per-token Python: tests/engine/test_multi_step.py compares
        the two); stop strings need the text of each token, so a request with text is applied a token at a time."""
        before = len(self.output_token_ids)
        max_tokens = self.max_tokens
        kept = max(1, min(len(token_ids), max_tokens - before))  # the token that reaches max_tokens is the last kept
        status = RequestStatus.FINISHED_LENGTH if before + kept >= max_tokens else None
        params = self.sampling_params
        eos = () if params.ignore_eos else self.eos_token_ids
        first = max(0, params.min_tokens - before - 1)
        # The first stopping token from min_tokens on (it wins over the length); looked for a token at a time only
        # where the window holds one (most windows hold none).
        if (eos or params.stop_token_ids) and not {*eos, *params.stop_token_ids}.isdisjoint(token_ids[first:kept]):
            for i in range(first, kept):
                token = token_ids[i]
                if token in eos or token in params.stop_token_ids:
                    kept, status = i + 1, RequestStatus.FINISHED_STOPPED
                    self.stop_reason = None if token in eos else token
                    break
        window = token_ids[:kept]
        self.output_token_ids.extend(window)
        self.all_token_ids.extend(window)
        return kept, status

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last sampled token implies, if any (stop strings are checked elsewhere)."""
        output = self.output_token_ids
        if not output:
            return None
        last, num_output = output[-1], len(output)  # (once: every sampled token comes here)
        params = self.sampling_params
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
