"""What a caller asks of one generation: how to sample, and when to stop."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field

from boundless.engine.bad_words import MAX_BAD_WORDS
from boundless.engine.errors import InvalidRequestError
from boundless.engine.structured_output import StructuredOutput
from boundless.engine.thinking_budget import ThinkingBudget

# Seeds are signed 64-bit integers, as vLLM takes them; torch.Generator.manual_seed accepts all of them.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
GREEDY_BELOW = 1e-5  # temperatures under it sample greedily
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a token's logit bias
MAX_LOGPROBS = 20  # alternatives per token at most by default (OpenAI's top_logprobs; --max-logprobs, vLLM's default)


class InvalidSamplingParams(InvalidRequestError):
    """A sampling parameter is out of range."""


class RequestOutputKind(enum.Enum):
    """When a request's text comes (vLLM's names): ``DELTA``, with each token as it is made (a stream);
    ``FINAL_ONLY``, whole with the request's last delta, the deltas before it carrying tokens only. A final-only
    request without stop strings is decoded once, at its end, instead of at every step (``LLM.generate`` and a
    response that is not streamed read the text at the end alone)."""

    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules, with the meanings OpenAI and vLLM give them.

    ``temperature == 0`` (or under ``GREEDY_BELOW``) is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` (a signed 64-bit integer) makes a request's samples reproducible whatever else is in the batch.
    ``stop_token_ids`` must be ids of the model's vocabulary (the engine knows its size). ``logprobs``
    asks for that many top alternatives per generated token (0: only the sampled token's); ``prompt_logprobs`` (vLLM's)
    for each prompt token's logprob given the tokens before it, with that many alternatives (the first token has
    none: nothing predicts it). ``detokenize=False``
    (vLLM's) returns token ids only, with no text, and skips the per-token decoding (the simulator's calls: nothing
    reads their text); it cannot go with stop strings, which are found in the text. ``output_kind``
    (:class:`RequestOutputKind`) says whether the text comes with each delta or whole at the end.

    Penalties, as OpenAI and vLLM define them: ``presence_penalty`` is subtracted from the logit of every token the
    output holds so far and ``frequency_penalty`` once per occurrence (both in [-2, 2]); ``repetition_penalty``
    (vLLM's and transformers', > 0) divides a positive logit and multiplies a negative one of every token in the
    prompt or the output. ``logit_bias`` adds a bias in [-100, 100] to a token's logit (pairs of token id and bias).
    They change the distribution sampled from, greedy included, not the reported ``logprobs`` (the model's raw
    ones, as vLLM reports them). ``min_p`` (vLLM's) drops tokens less likely than ``min_p`` times the most likely
    one after temperature.

    ``allowed_token_ids`` (vLLM's) are the only tokens that may be sampled (None: any); ``bad_words`` (vLLM's) are
    words the output may not hold: the engine tokenizes each (:mod:`boundless.engine.bad_words`) into
    ``bad_words_token_ids``, and the last token of each sequence is banned wherever the tokens before it end the output
    so far. Both are masks on the logits, as ``logit_bias`` is applied, greedy and speculative rows alike.

    ``structured`` holds the output to a grammar (``response_format``: any JSON object, or JSON under a schema;
    ``structured_outputs``: those, a regex, a choice, an EBNF grammar; ``engine/structured_output.py``). It cannot
    go with ``ignore_eos`` or ``min_tokens``: the grammar allows EOS only, and at once, where the output is complete.
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    # ``bad_words`` as token sequences (vLLM's ``_bad_words_token_ids``): filled by the engine from its tokenizer when a
    # request arrives (``EngineCore``, which then drops the words), so that every instance a request reaches bans the
    # same tokens; a caller with token ids may give sequences here directly, with no ``bad_words`` (both: refused).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured: StructuredOutput | None = None
    # The LoRA adapter the request runs with (None: the base model): set from vLLM's ``lora_request`` (``LLM``) or the
    # request's ``model`` (the server). It travels in the parameters, so that every path a request takes (another
    # instance after a failover, a decode engine after its prefill) runs it with the same weights.
    lora_name: str | None = None
    # vLLM's ``cache_salt``: KV is shared through the prefix cache only among requests with the same salt (and none
    # with none), so that one tenant cannot learn another's prompts from how fast its own are answered.
    cache_salt: str | None = None
    # vLLM's request ``priority``: a class of service, smaller first. The scheduler orders requests by it, then by its
    # policy within a class (fcfs, plas, atlas...), so a request outranks every one of a larger value, waiting or
    # running (it takes a running one's place, as the policy's own order does). 0 for all: the policy's order alone.
    # It travels in the parameters, so that every instance a request reaches ranks it alike.
    priority: int = 0
    # OpenAI's Predicted Outputs: tokens the answer is likely to hold (a file being rewritten). They are drafts for
    # speculative decoding (``engine/prediction.py``): the answer is the same with or without them, only faster.
    prediction: tuple[int, ...] = ()
    # vLLM's ``thinking_token_budget``: a reasoning model's thinking closed, its end tag forced, after this many tokens
    # (``engine/thinking_budget.py``). None: it thinks as long as it likes.
    thinking_budget: ThinkingBudget | None = None
    # vLLM's ``truncate_prompt_tokens``: only the prompt's last this many tokens are read (-1: as many as the context
    # holds), for a history that has outgrown the context. ``LLM.generate`` applies it (``truncated_prompt``, which the
    # server's routes apply to their request's own field); the engine takes a prompt's ids as they are given.
    truncate_prompt_tokens: int | None = None
    # An embedding request (``/v1/embeddings``, ``LLM.embed``): its prompt's last hidden state, pooled as the model's
    # directory says (``model/pooling.py``), comes with its one delta (``RequestDelta.embedding``); the one token it
    # samples (``max_tokens`` 1) is not an answer.
    embed: bool = False
    # Whether a penalty needs the request's tokens so far; whether anything does (a grammar replays a handed-off
    # request's): the scheduler hands them to the sampler only then.
    penalized: bool = field(init=False, repr=False, compare=False, default=False)
    needs_history: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        # None for a list or a mapping is "none", as vLLM's optional fields take it (``stop=cfg.get("stop")``).
        for name in ("stop", "stop_token_ids", "bad_words", "bad_words_token_ids", "logit_bias", "prediction"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "prediction", tuple(self.prediction))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(self.bad_words)))  # (vLLM drops repeats)
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        object.__setattr__(
            self,
            "penalized",
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0,
        )
        object.__setattr__(
            self,
            "needs_history",
            self.penalized
            or self.structured is not None
            or self.thinking_budget is not None
            or any(len(word) > 1 for word in self.bad_words_token_ids),  # (a one-token word is banned everywhere)
        )
        self._check("n", _is_int(self.n) and self.n >= 1, "n must be an integer >= 1")
        self._check(
            "temperature",
            _is_number(self.temperature) and 0.0 <= self.temperature <= 2.0,
            "temperature must be in [0, 2]",
        )
        self._check("top_p", _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        self._check("top_k", _is_int(self.top_k) and self.top_k >= -1, "top_k must be -1, 0 or positive")
        if self.seed is not None:
            self._check(
                "seed",
                _is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX,
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (signed 64-bit)",
            )
        if self.max_tokens is not None:
            self._check(
                "max_tokens",
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens must be a positive integer",
            )
        self._check(
            "min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be an integer >= 0"
        )
        self._check("priority", _is_int(self.priority), "priority must be an integer")
        self._check("prediction", all(_is_int(t) and t >= 0 for t in self.prediction), "prediction must be token ids")
        self._check(
            "thinking_token_budget",
            self.thinking_budget is None or isinstance(self.thinking_budget, ThinkingBudget),
            "thinking_budget must be a ThinkingBudget",
        )
        if self.max_tokens is not None:
            self._check("min_tokens", self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens")
        if self.logprobs is not None:
            self._check(
                "logprobs",
                _is_int(self.logprobs) and self.logprobs >= 0,
                "logprobs must be a non-negative integer (at most the engine's max_logprobs)",
            )
        if self.prompt_logprobs is not None:
            self._check(
                "prompt_logprobs",
                _is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0,
                "prompt_logprobs must be a non-negative integer (at most the engine's max_logprobs)",
            )
        self._check("stop", all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        self._check("stop", self.detokenize or not self.stop, "stop strings need detokenize (found in the text)")
        self._check(
            "output_kind", isinstance(self.output_kind, RequestOutputKind), "output_kind must be a RequestOutputKind"
        )
        self._check(
            "stop_token_ids",
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check(name, _is_number(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2]")
        self._check(
            "repetition_penalty",
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
            "repetition_penalty must be in (0, 100]",
        )
        self._check("min_p", _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        self._check(
            "logit_bias",
            all(
                _is_int(t) and t >= 0 and _is_number(b) and -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT
                for t, b in self.logit_bias
            ),
            f"logit_bias maps non-negative token ids to biases in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
        )
        self._check(
            "logit_bias",
            len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
            "logit_bias names a token twice",
        )
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in self.logit_bias))
        if self.allowed_token_ids is not None:
            self._check("allowed_token_ids", bool(self.allowed_token_ids), "allowed_token_ids must not be empty")
            self._check(
                "allowed_token_ids",
                all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids must be non-negative integers",
            )
        self._check(
            "bad_words", all(isinstance(w, str) and w for w in self.bad_words), "bad_words must be non-empty strings"
        )
        # vLLM derives its token sequences from the words alone (its ``_bad_words_token_ids`` is internal): given both,
        # one would silently replace the other.
        self._check(
            "bad_words",
            not (self.bad_words and self.bad_words_token_ids),
            "give bad_words or bad_words_token_ids, not both (the words' token sequences would replace the ids)",
        )
        self._check(
            "bad_words",
            all(w and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_token_ids),
            "bad_words_token_ids must be non-empty sequences of non-negative integers",
        )
        self._check(  # (each word is a sequence at least: a list too long is refused before it is tokenized)
            "bad_words",
            len(self.bad_words) <= MAX_BAD_WORDS and len(self.bad_words_token_ids) <= MAX_BAD_WORDS,
            f"bad_words: more than {MAX_BAD_WORDS} token sequences (each word's, and after a space)",
        )
        if self.structured is not None:
            where = self.structured.param
            self._check(where, not self.ignore_eos, f"{where} cannot go with ignore_eos")
            self._check(where, self.min_tokens == 0, f"{where} cannot go with min_tokens")
        self._check(
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
            ),
            "truncate_prompt_tokens must be -1 or a positive integer",
        )
        self._check(
            "cache_salt",
            self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
            "cache_salt must be a non-empty string if given",
        )

    @staticmethod
    def _check(param: str, ok: bool, message: str) -> None:
        if not ok:
            raise InvalidSamplingParams(message, param)

    @property
    def greedy(self) -> bool:
        # Below GREEDY_BELOW the sample is the argmax anyway, and logits / temperature would overflow float32.
        return self.temperature < GREEDY_BELOW

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the ``index``-th of ``n`` samples: one sample, and a seed of its own (``seed + index``,
        wrapped into the signed 64-bit range so that every seed the params accept has ``n`` children)."""
        if self.n == 1:  # (its one sample's params are its own: frozen, so shared)
            return self
        # A copy, not dataclasses.replace: its checks ran once (replace ran them again for every sample, over every
        # stop string and bias: 3 s on the event loop for 128 samples of a whole vocabulary's logit_bias). The
        # samples share the tuples, and what is made once for them (engine/stop_strings.py, the sampler's biases).
        child = copy.copy(self)
        object.__setattr__(child, "n", 1)
        if self.seed is not None:
            object.__setattr__(child, "seed", (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN)
        return child


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the context's length); the prompt whole
    with None."""
    length = truncation_length(keep, max_model_len)
    return ids if length is None else ids[-length:]


def truncation_length(keep: int | None, max_model_len: int) -> int | None:
    """How many tokens vLLM's ``truncate_prompt_tokens`` keeps (-1: the context's length; None: all), refused in words
    out of range."""
    if keep is None:
        return None
    if not _is_int(keep) or keep == 0 or keep < -1 or keep > max_model_len:
        raise InvalidSamplingParams(
            f"truncate_prompt_tokens must be -1 or 1 to the model's context ({max_model_len}), not {keep}",
            "truncate_prompt_tokens",
        )
    return max_model_len if keep == -1 else keep


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool): NaN would pass every range check."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
