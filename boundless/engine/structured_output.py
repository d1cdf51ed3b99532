"""Structured outputs: a request's tokens held to a grammar (OpenAI's ``response_format``: any JSON object, or JSON
following a schema; vLLM's ``structured_outputs``: those, a regular expression, a choice of strings or an EBNF
grammar), with xgrammar, the library vLLM and SGLang use.

Each step, the sampler asks a request's :class:`GrammarMatcher` which tokens may come next (a bitmask over the
vocabulary), forbids the others in its logits, and tells the matcher the token it drew. A grammar is compiled once
per engine for the tokenizer's vocabulary (:class:`Grammars`, cached by spec); a matcher is a request's position in
it. The grammar allows the model's EOS only where the output is complete, so a request ends with valid JSON unless
``max_tokens`` or a stop string cuts it first (``finish_reason`` says so, as OpenAI's does).

xgrammar is imported on first use: an engine that serves no structured request never loads it.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from boundless.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from boundless.model.tokenizer import Tokenizer

StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
# Whitespace between two of JSON's tokens, at most: room for a pretty-printed object's newline and indent eight
# levels deep, not for a weak model's endless run of blanks (what vLLM's --disable-any-whitespace is for).
MAX_WHITESPACE = 32
# The memory an engine's compiled grammars may hold: vLLM's default for xgrammar's cache (VLLM_XGRAMMAR_CACHE_MB).
# A JSON grammar's token masks grow with the vocabulary: ~4 MB each at SmolLM2's 49 K tokens (so ~128 kept), ~11 MB
# at Llama 3's 128 K (~50); a regex's, a choice's or a small EBNF's a few KB.
GRAMMAR_CACHE_BYTES = 512 << 20
# And the number kept, whatever their size (a schema's grammar is 10-30 ms to compile for a 49 K vocabulary, a small
# grammar's under a millisecond): each also holds its spec's text and Python's bookkeeping, which its bytes omit.
MAX_GRAMMARS = 256
# The most strings a choice may hold, and tools a grammar may hold calls to (a forced call's, strict tools'): their
# grammars' compilation grows faster than they do (a forced call of 1,000 tools 0.8 s and 60 MB, of 4,000 14.5 s and
# 880 MB, of 20,000 a server killed for want of memory; a choice of 16,000 strings 3.3 s, of 100,000 two minutes and
# a GB). OpenAI takes 128 tools.
MAX_CHOICES = 8192
MAX_GRAMMAR_TOOLS = 512


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be: ``json_object`` (any JSON object), ``json_schema`` (JSON valid under the
    JSON Schema ``definition``), ``regex`` (text matching the regular expression ``definition``), ``choice`` (one
    of the strings in ``definition``, a JSON list), ``grammar`` (text of the EBNF grammar ``definition``, in
    xgrammar's dialect of GBNF, from its ``root`` rule) or ``structural_tag`` (xgrammar's structural tag, its JSON:
    free text with parts held to formats, such as tool calls held to their schemas once the model begins one).
    ``param``: the request's field it came from, which errors name. ``after``: token ids that the grammar begins
    after (a reasoning model's end of thinking, ``</think>``): until the output holds them it is free, so the model
    thinks first, as vLLM lets it; they are not part of the grammar, so one compilation serves every ``after``.
    ``after_close``: with it, the grammar begins past the first ``after_close`` within :data:`MAX_HEADER_TOKENS` of
    ``after`` (a header whose middle varies: harmony's ``<|channel|>final``, perhaps `` <|constrain|>json``, then
    ``<|message|>``, as vLLM's gpt-oss parser ends the reasoning)."""

    kind: StructuredKind
    definition: str | None = None
    param: str = field(default="response_format", compare=False)
    after: tuple[int, ...] = field(default=(), compare=False)
    after_close: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output {self.kind!r}", self.param)
        if (self.kind == "json_object") != (self.definition is None):
            raise InvalidRequestError(f"a {self.kind} output needs its definition, and only it", self.param)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, param: str = "response_format") -> StructuredOutput:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), param)

    @classmethod
    def choice(cls, options: Sequence[str], param: str = "structured_outputs") -> StructuredOutput:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequestError("a choice needs one or more non-empty strings", param)
        if len(options) > MAX_CHOICES:
            raise InvalidRequestError(f"a choice of {len(options)} strings: at most {MAX_CHOICES}", param)
        return cls("choice", json.dumps(list(options), ensure_ascii=False), param)


# The tokens a header may hold between ``after`` and ``after_close`` (StructuredOutput; vLLM's gpt-oss parser's 20).
MAX_HEADER_TOKENS = 20


def grammar_start(outputs: Sequence[int], after: Sequence[int], close: Sequence[int] = ()) -> int | None:
    """Where a grammar that begins ``after`` those tokens begins in ``outputs``: just past their first occurrence
    (0 with no ``after``); with ``close``, just past the first ``close`` that follows an occurrence within
    :data:`MAX_HEADER_TOKENS` tokens. None while they have not occurred."""
    if not after:
        return 0
    at = 0
    while (found := _find(outputs, after, at)) is not None:
        end = found + len(after)
        if not close:
            return end
        header = outputs[end : end + MAX_HEADER_TOKENS + len(close)]
        closed = _find(header, close, 0)
        if closed is not None:
            return end + closed + len(close)
        if len(header) < MAX_HEADER_TOKENS + len(close):
            return None  # (the header may still close)
        at = found + 1
    return None


def _find(outputs: Sequence[int], tokens: Sequence[int], start: int) -> int | None:
    """The first index from ``start`` where ``tokens`` occur in ``outputs``, or None."""
    first, n = tokens[0], len(tokens)
    at = start - 1
    while True:
        try:
            at = outputs.index(first, at + 1)  # (a C scan: the thinking before the tag may be thousands of tokens)
        except ValueError:
            return None
        if tuple(outputs[at : at + n]) == tuple(tokens):
            return at


def _xgrammar(param: str) -> Any:
    try:
        import xgrammar
    except ImportError as e:  # installed by `make serve` and `make test`; optional for the package
        raise InvalidRequestError("structured outputs need the xgrammar package, which this server lacks", param) from e
    return xgrammar


@functools.lru_cache(maxsize=MAX_GRAMMARS)
def check_structured_output(spec: StructuredOutput, vocab_size: int) -> None:
    """Raise :class:`InvalidRequestError` unless the spec's grammar can be built and compiled (a schema, regex or
    grammar xgrammar can read) for a vocabulary of ``vocab_size`` ids. Needs no tokenizer: an engine checks a request
    before it queues it. Remembered for the specs that passed (a server's front end and its engine check each
    request).

    It is compiled for a stand-in vocabulary: ``vocab_size`` ids, the first 256 each a byte and the next the end (a
    millisecond for a schema: the vocabulary's text is what a real compilation spends its time on), and refused if it
    allows no first token at all. xgrammar builds some grammars it
    then cannot compile (a JSON schema's negative ``minLength``), and a compilation that failed in the engine's step
    would fail the step's every request, not this one alone; the ids let a grammar name tokens
    (``TokenTagDispatch``). A compiler of its own each call, without a cache: checks run on the server's worker
    threads at once, and a cache would keep every schema checked."""
    xgr = _xgrammar(spec.param)
    grammar = _grammar(xgr, spec)
    # Every byte a token of its own, then the end token: whether the grammar allows any first byte (or the end) is
    # whether it allows any output at all, whatever the real vocabulary.
    vocab: list[bytes | str] = [bytes([b]) for b in range(256)]
    info = xgr.TokenizerInfo(
        vocab + ["</s>"], xgr.VocabType.RAW, vocab_size=max(vocab_size, len(vocab) + 1), stop_token_ids=[len(vocab)]
    )
    try:
        compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(grammar)
    except Exception as e:  # xgrammar raises RuntimeError with the reason
        raise _unusable(spec, e) from e
    first = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first)
    if not bool(first.any()):  # (root ::= root; a character class of nothing): each step would have no token to take
        raise InvalidRequestError(f"{spec.param}: the {spec.kind} allows no output at all", spec.param)


def _unusable(spec: StructuredOutput, error: Exception) -> InvalidRequestError:
    """The request's error for a definition xgrammar refused (building or compiling its grammar), with xgrammar's
    reason without the time and C++ source line it begins with (``[20:29:36] /project/...cc:820: ``)."""
    reason = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(error)).strip()
    return InvalidRequestError(f"{spec.param}: the {spec.kind} cannot be used: {reason}", spec.param)


def _grammar(xgr: Any, spec: StructuredOutput) -> Any:
    try:
        if spec.kind == "json_object":
            # An object, as OpenAI's JSON mode promises (xgrammar's built-in JSON grammar takes arrays and scalars
            # too); not strict, so that it may hold any properties.
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', strict_mode=False, max_whitespace_cnt=MAX_WHITESPACE
            )
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.definition, max_whitespace_cnt=MAX_WHITESPACE)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.definition)
        if spec.kind == "choice":
            # Each option a string literal of the grammar (JSON's escapes are the grammar's).
            options = json.loads(spec.definition or "[]")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.definition)
        return xgr.Grammar.from_ebnf(spec.definition)
    except Exception as e:  # xgrammar raises RuntimeError or ValueError, with the reason
        raise _unusable(spec, e) from e


class Grammars:
    """Grammars compiled for one tokenizer's vocabulary (``vocab_size``: the logits' width, which may exceed the
    tokenizer's), with the model's EOS ids as the tokens that end an output.

    Kept while they hold at most ``max_bytes`` (:data:`GRAMMAR_CACHE_BYTES`; xgrammar's ``memory_size_bytes``, and
    the spec's text) and number at most ``max_grammars`` (:data:`MAX_GRAMMARS`), the least recently used let go
    first, but never one in use: one compiling (a request waits for it) or one a live matcher holds (a running
    request's, which the sampler keeps until the request ends, preempted or not, and remakes from here when its
    outputs change under it). Those alone may hold more than the budget (they are in memory whatever the cache does).

    Compiling takes the engine's first structured request seconds (xgrammar reads the vocabulary) and each new
    schema milliseconds to a second, so it runs on a thread of its own (:meth:`prepare`), mostly outside the GIL:
    the engine holds the request back until :meth:`ready` says its grammar is, and its other requests keep stepping
    meanwhile (vLLM's requests wait for their grammars alike). ``notify`` is called when a compilation ends (an
    engine loop waiting for work wakes)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_bytes: int | None = None,
        max_grammars: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_bytes = GRAMMAR_CACHE_BYTES if max_bytes is None else max_bytes
        self.max_grammars = MAX_GRAMMARS if max_grammars is None else max_grammars
        self.notify: Callable[[], None] | None = None
        self._compiler: Any = None
        self._compiled: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()  # least recently used first
        self._sizes: dict[StructuredOutput, int] = {}  # the compiled ones' bytes
        self._held = 0  # their sum
        self._users: dict[StructuredOutput, int] = {}  # live matchers of each (none: no entry)
        # Matchers gone (their specs), told by their finalizers, which wait for no lock (one may run in the garbage
        # collector while this thread holds it): counted off under the lock (_count_gone).
        self._gone: deque[StructuredOutput] = deque()
        self._lock = threading.Lock()  # the cache, shared with the compiling thread's callbacks
        self._pool: ThreadPoolExecutor | None = None

    @property
    def held_bytes(self) -> int:
        """The bytes the kept grammars hold (those compiled; one compiling is counted when it ends)."""
        return self._held

    def in_use(self, spec: StructuredOutput) -> bool:
        """Whether a live matcher holds the spec's grammar."""
        with self._lock:
            self._count_gone()
            return spec in self._users

    def prepare(self, spec: StructuredOutput) -> bool:
        """Start compiling the spec's grammar unless it is compiled or compiling; whether it is :meth:`ready`."""
        return self._future(spec).done()

    def _future(self, spec: StructuredOutput, use: bool = False) -> Future[Any]:
        """The spec's compilation, started if it is not compiled or compiling (``use``: counted a user, for a
        matcher about to be made, before the lock is let go, so that nothing lets it go in between)."""
        with self._lock:
            future = self._compiled.get(spec)
            if future is not None:
                self._compiled.move_to_end(spec)
            else:
                if self._pool is None:  # one thread: compilations share the compiler, in turn
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
                future = self._pool.submit(self._compile, spec)
                self._compiled[spec] = future
            if use:
                self._users[spec] = self._users.get(spec, 0) + 1
            self._evict()
        future.add_done_callback(self._compiled_one)
        return future

    def _count_gone(self) -> None:
        """Count off the matchers gone since (under the lock)."""
        while self._gone:
            spec = self._gone.popleft()
            left = self._users.get(spec, 0) - 1
            if left > 0:
                self._users[spec] = left
            else:
                self._users.pop(spec, None)

    def _evict(self) -> None:
        """Let the least recently used grammars not in use go until the rest are within the budget (under the
        lock)."""
        self._count_gone()
        if self._held <= self.max_bytes and len(self._compiled) <= self.max_grammars:
            return
        for spec in list(self._compiled):
            if self._held <= self.max_bytes and len(self._compiled) <= self.max_grammars:
                return
            if spec in self._users or not self._compiled[spec].done():
                continue
            del self._compiled[spec]
            self._held -= self._sizes.pop(spec, 0)

    def ready(self, spec: StructuredOutput | None) -> bool:
        """Whether the spec's grammar is compiled (or its compilation failed, which :meth:`matcher` raises); no spec:
        nothing to wait for."""
        with self._lock:
            future = self._compiled.get(spec) if spec is not None else None
        return future is None or future.done()  # (not prepared, or dropped: a matcher compiles it where it is)

    def error(self, spec: StructuredOutput) -> str | None:
        """Why the spec's compilation failed, if it ended so (None: it compiled, or it has not ended)."""
        with self._lock:
            future = self._compiled.get(spec)
        error = future.exception() if future is not None and future.done() else None
        return None if error is None else str(error)

    def wait(self, specs: Iterable[StructuredOutput], timeout_s: float) -> None:
        """Wait until one of these specs' grammars is ready, at most ``timeout_s`` (for an engine with nothing else
        to do)."""
        with self._lock:
            futures = [f for f in (self._compiled.get(s) for s in specs) if f is not None]
        if futures:
            wait(futures, timeout_s, return_when=FIRST_COMPLETED)

    def _compiled_one(self, _: Future[Any]) -> None:
        if self.notify is not None:
            self.notify()

    def _compile(self, spec: StructuredOutput) -> Any:
        xgr = _xgrammar(spec.param)
        if self._compiler is None:
            # Without xgrammar's own cache: ``_compiled`` is the cache, bounded by bytes. xgrammar's, unbounded by
            # default, kept every grammar ever compiled (4 MB each on SmolLM2's vocabulary): a server given a new
            # schema per request grew without end; bounded, it would keep a second copy of the grammars kept here.
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr), max_threads=1, cache_enabled=False)
        compiled = None
        try:
            grammar = _grammar(xgr, spec)
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except Exception as e:  # (xgrammar's RuntimeError, with the reason)
                raise _unusable(spec, e) from e
            return compiled
        finally:  # counted before the future is done (whoever waits on it sees the count), then the budget kept
            with self._lock:
                if spec in self._compiled and spec not in self._sizes:  # (it is: one compiling is never let go)
                    self._sizes[spec] = len(spec.definition or "") + (compiled.memory_size_bytes if compiled else 0)
                    self._held += self._sizes[spec]
                    self._evict()

    def _tokenizer_info(self, xgr: Any) -> Any:
        """The vocabulary as xgrammar sees it: its own reading of a fast tokenizer (each id's token, the vocabulary's
        kind and prefix space), over the engine's Rust tokenizer."""
        from transformers import PreTrainedTokenizerFast

        return xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend),
            vocab_size=self.vocab_size,
            stop_token_ids=list(self.tokenizer.eos_token_ids),
        )

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A new matcher at the start of the spec's grammar (waiting for it, or compiling it, if it is not ready). The
        grammar is kept while the matcher lives."""
        future = self._future(spec, use=True)
        try:
            matcher = GrammarMatcher(_xgrammar(spec.param).GrammarMatcher(future.result()))
        except BaseException:
            self._gone.append(spec)
            raise
        weakref.finalize(matcher, _matcher_gone, weakref.ref(self), spec).atexit = False
        return matcher

    def _matcher_gone(self, spec: StructuredOutput) -> None:
        """A matcher of the spec's is gone (a request ended): counted off, and the budget kept, now if the lock is
        free (from the thread that let the matcher go, the engine's), else at the cache's next use. Never waits for
        the lock: a finalizer may run in the garbage collector while this very thread holds it."""
        self._gone.append(spec)
        if self._lock.acquire(blocking=False):
            try:
                self._evict()
            finally:
                self._lock.release()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _matcher_gone(grammars: weakref.ref[Grammars], spec: StructuredOutput) -> None:
    """A matcher's finalizer (holding its :class:`Grammars` weakly: a live matcher does not keep it)."""
    owner = grammars()
    if owner is not None:
        owner._matcher_gone(spec)


class GrammarMatcher:
    """One request's place in its grammar: which tokens may come next, and each token it took. A grammar may reach a
    place where it allows no token at all (a dead end its check at the start could not see, such as a character class
    of nothing after a first character): there the sampler takes the request's end token instead and the matcher is
    ``done``, so the request ends alone rather than failing its step's every request."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.num_tokens = 0  # tokens accepted
        self.dead_end = False  # the grammar allowed no token: ended by the end token
        self._empty_at: set[int] = set()  # places (tokens accepted) whose mask allowed no token

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            if self.num_tokens in self._empty_at:
                self.dead_end = True  # (the end token the sampler took there)
                return
            raise RuntimeError(f"token {token_id} breaks the request's grammar")
        self.num_tokens += 1

    @property
    def done(self) -> bool:
        """The output is complete and its end token taken (or the grammar reached a dead end): nothing more is
        constrained."""
        return self.dead_end or bool(self._matcher.is_terminated())

    def replay(self, token_ids: Sequence[int]) -> None:
        """Accept tokens the request drew before this matcher was made (a prefill engine's, after a handoff)."""
        for token_id in token_ids:
            self.accept(token_id)

    def fill_draft_masks(self, bitmask: Any, first: int, drafts: Sequence[int]) -> None:
        """Speculative decoding: the masks of a chunk's sampling positions, bitmask rows ``first`` on (after the last
        known token, then after each draft), each with the drafts before it taken, and then the drafts let go again
        (the matcher ends where it began). Past a draft the grammar refuses, the rows are left open: the position
        before it gives that draft no chance, so nothing sampled after it is kept."""
        matcher = self._matcher
        taken = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                break  # a draft took the end token: the output is complete, and the rows after it are discarded
            matcher.fill_next_token_bitmask(bitmask, first + j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)

    def allowed_nothing(self, j: int) -> None:
        """Its mask ``j`` positions on (a speculating chunk's row ``j``) allowed no token: a dead end, where the sampler
        takes the end token (:meth:`accept` then ends it)."""
        self._empty_at.add(self.num_tokens + j)


def mask_logits(
    logits: torch.Tensor,
    rows: list[int],
    matchers: list[GrammarMatcher],
    drafts: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Forbid, in place, every token that row ``rows[j]``'s grammar (``matchers[j]``) does not allow next. With
    ``drafts`` (speculative decoding), ``matchers[j]`` covers ``len(drafts[j]) + 1`` rows from ``rows[j]``'s, one
    per sampling position of its chunk (:meth:`GrammarMatcher.fill_draft_masks`; rows left open allow every token,
    the bitmask's initial value). Returns the rows whose grammar allows no token (a dead end), all forbidden: the
    caller gives each its request's end token."""
    xgr = _xgrammar("structured_outputs")
    drafts = drafts or [()] * len(matchers)
    rows = [row + k for row, d in zip(rows, drafts, strict=True) for k in range(len(d) + 1)]
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    firsts = []
    first = 0
    for m, d in zip(matchers, drafts, strict=True):
        m.fill_draft_masks(bitmask, first, d)
        firsts.append(first)
        first += len(d) + 1
    index = torch.tensor(rows, device=logits.device)
    picked = logits[index].contiguous()  # (a copy: rows chosen by index)
    xgr.apply_token_bitmask_inplace(picked, bitmask.to(logits.device))
    logits[index] = picked
    # Dead ends (rows left open allow every token, so only a filled row can be empty), each told to its matcher.
    empty = (~bitmask.any(dim=1)).nonzero().flatten().tolist()
    for k in empty:
        owner = bisect.bisect_right(firsts, k) - 1
        matchers[owner].allowed_nothing(k - firsts[owner])
    return [rows[k] for k in empty]
