"""What a caller asks of one generation: how to sample, and when to stop."""

from __future__ import annotations

from dataclasses import dataclass

from boundless.engine.errors import InvalidRequestError


class InvalidSamplingParams(InvalidRequestError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules, with the meanings OpenAI and vLLM give them.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a request's samples reproducible whatever else is in the batch. ``logprobs``
    asks for that many top alternatives per generated token (0: only the sampled token's).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check("n", isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1")
        self._check("temperature", 0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]")
        self._check("top_p", 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        self._check("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be -1, 0 or positive")
        if self.max_tokens is not None:
            self._check(
                "max_tokens",
                isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
                "max_tokens must be a positive integer",
            )
        self._check("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens must be >= 0")
        if self.max_tokens is not None:
            self._check("min_tokens", self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens")
        if self.logprobs is not None:
            self._check("logprobs", 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")
        self._check("stop", all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")

    @staticmethod
    def _check(param: str, ok: bool, message: str) -> None:
        if not ok:
            raise InvalidSamplingParams(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
