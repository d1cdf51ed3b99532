"""The offline API: ``LLM(model).generate(prompts, sampling_params)`` and ``LLM.chat(messages, sampling_params)``."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from tqdm import tqdm

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, vllm_engine_args
from boundless.engine.core import EngineCore
from boundless.engine.logprobs import PositionLogprobs, SampledToken, as_position_logprobs, named_tokens
from boundless.engine.sampling_params import RequestOutputKind, SamplingParams, truncated_prompt, truncation_length
from boundless.engine.tensor_parallel import TensorParallelRanks, load_with_ranks
from boundless.gc_quiet import frozen_heap
from boundless.model.classifier import pair_ids, score_pairs, scores
from boundless.model.loader import LoadedModel
from boundless.model.lora import LoRARequest
from boundless.model.pooling import PoolingParams
from boundless.model.tokenizer import Tokenizer, load_chat_template

# A text, token ids, or vLLM's prompt dicts: ``{"prompt": text}`` (TextPrompt), ``{"prompt_token_ids": ids}``
# (TokensPrompt, which may carry its text as ``prompt`` too), either with ``cache_salt``.
Prompt = str | list[int] | Mapping[str, Any]

# The keys of vLLM's prompt dicts this engine reads. Its multimodal keys are taken empty only: the models served here
# read text.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data", "mm_processor_kwargs"})


@dataclass
class CompletionOutput:
    """One sampled continuation of a prompt, as vLLM's: ``logprobs`` (when asked for) hold, for each generated token,
    its own and its top alternatives' :class:`~boundless.engine.logprobs.Logprob` by token id; ``cumulative_logprob``
    is the sum of the generated tokens' logprobs."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and its ``n`` completions; with ``SamplingParams.prompt_logprobs``, each prompt token's logprob given
    the tokens before it (None for the first), in vLLM's shape (:class:`CompletionOutput`'s ``logprobs``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False


@dataclass
class EmbeddingOutput:
    """vLLM's: a prompt's embedding (``LLM.embed``), pooled as the model's directory says (``model/pooling.py``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: a prompt and its embedding."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = False


@dataclass
class ClassificationOutput:
    """vLLM's: a prompt's labels' probabilities (``LLM.classify``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = False


@dataclass
class ScoringOutput:
    """vLLM's: a pair's relevance (``LLM.score``)."""

    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = False


@dataclass
class _Sample:
    """One of a prompt's samples while its batch runs: where its deltas go, and its scored tokens in the engine's
    shape (made into vLLM's when the batch is done: every token's text in one decode)."""

    result: RequestOutput
    completion: CompletionOutput
    params: SamplingParams
    scored: list[SampledToken] | None
    prompt_scored: list[SampledToken | None] | None = None


@dataclass(frozen=True)
class _PromptInput:
    """A prompt as given: its text, or its token ids (and then perhaps its text too), and a ``cache_salt``."""

    text: str | None
    ids: list[int] | None
    cache_salt: str | None = None


def engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """An :class:`EngineConfig` from flat keyword arguments named as the config fields (and flags)."""
    parts: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}, CacheConfig: {}, SchedulerConfig: {}}
    for key, value in kwargs.items():
        # vLLM's: the flag's JSON, a dict
        if key in ("speculative_config", "hf_overrides", "kv_events_config") and isinstance(value, dict):
            value = json.dumps(value)
        for cls, values in parts.items():
            if key in {f.name for f in dataclasses.fields(cls)}:
                values[key] = value
                break
        else:
            raise TypeError(f"unknown engine option {key!r}")
    return EngineConfig(
        model=ModelConfig(**parts[ModelConfig]),
        cache=CacheConfig(**parts[CacheConfig]),
        scheduler=SchedulerConfig(**parts[SchedulerConfig]),
    )


class LLM:
    """Generate offline with one engine in this process.

    ``LLM("smollm2-135m")`` loads the bundled model; any Hugging Face directory or GGUF file works.
    Keyword arguments are engine options (``dtype``, ``device``, ``max_model_len``, ``block_size``,
    ``num_kv_blocks``, ``enable_prefix_caching``, ``max_num_batched_tokens``, ...), and vLLM's engine arguments that
    mean something here (:func:`vllm_engine_args`).
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        self._start(engine_config(model, **vllm_engine_args(model, kwargs)), None)

    @classmethod
    def from_config(
        cls, config: EngineConfig, loaded: LoadedModel | None = None, ranks: TensorParallelRanks | None = None
    ) -> LLM:
        """An LLM from a full config; ``loaded`` reuses a model already in memory (tests, benchmarks), with a split
        model's other ranks ``ranks`` when they were launched beside it (``load_with_ranks``)."""
        llm = cls.__new__(cls)
        llm._start(config, loaded, ranks)
        return llm

    def _start(
        self, config: EngineConfig, loaded: LoadedModel | None, ranks: TensorParallelRanks | None = None
    ) -> None:
        if loaded is None:
            loaded, ranks = load_with_ranks(config)
        self.engine = EngineCore.from_model(loaded, config, ranks=ranks)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's name)."""
        return self.engine.tokenizer

    def close(self) -> None:
        """Finish the writes to the disk store (``kv_disk_path``), so that the next process finds every block."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or vLLM's ``{"prompt": ...}`` or
        ``{"prompt_token_ids": [...]}``); results come in prompt order. ``sampling_params``: for every prompt, or one
        per prompt. As vLLM's, an output stops where the context is full (``finish_reason`` ``length``), whatever
        ``max_tokens`` asked; a prompt past the context is refused. ``lora_request``
        (vLLM's): the LoRA adapter to run with, for every prompt or one per prompt (``enable_lora=True``); it is
        loaded on first use (a name already loaded runs with the adapter loaded under it). ``priority`` (vLLM's): each
        prompt's class of service, smaller first (``SamplingParams.priority``)."""
        batch = [_prompt_input(p) for p in _as_batch(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            per_prompt = [sampling_params] * len(batch)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params]  # (refused below, named)
        if not all(isinstance(p, SamplingParams) for p in per_prompt):
            wrong = next(p for p in per_prompt if not isinstance(p, SamplingParams))
            raise TypeError(f"sampling_params: a SamplingParams or a list of them, not {type(wrong).__name__}")
        if len(per_prompt) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(per_prompt)} sampling params")
        if priority is not None:
            if len(priority) != len(batch):
                raise ValueError(f"{len(batch)} prompts but {len(priority)} priorities")
            per_prompt = [dataclasses.replace(p, priority=rank) for p, rank in zip(per_prompt, priority, strict=True)]
        loras = [lora_request] * len(batch) if not isinstance(lora_request, Sequence) else list(lora_request)
        if not all(lora is None or isinstance(lora, LoRARequest) for lora in loras) or isinstance(lora_request, str):
            raise TypeError(f"lora_request: a LoRARequest or a list of them (None for none), not {lora_request!r:.60}")
        if len(loras) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(loras)} LoRA requests")
        for i, lora in enumerate(loras):
            if lora is not None:
                if lora.lora_name not in self.engine.loras:  # (one loaded already is used as it is)
                    self.engine.add_lora(lora)
                per_prompt[i] = dataclasses.replace(per_prompt[i], lora_name=lora.lora_name)
        for i, prompt in enumerate(batch):
            if prompt.cache_salt is not None:
                per_prompt[i] = dataclasses.replace(per_prompt[i], cache_salt=prompt.cache_salt)
        # The outputs are read when the batch is done (as vLLM's LLM does): each text is decoded once, at its end.
        # (Made once for each params object given: a batch's prompts most often share one.)
        given = {id(p): p for p in per_prompt}
        final = {key: dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for key, p in given.items()}
        per_prompt = [final[id(p)] for p in per_prompt]
        results: list[RequestOutput] = []
        samples: dict[str, _Sample] = {}
        max_model_len = self.engine.max_model_len
        # The collector's full walks skip the model and the engine (boundless/gc_quiet.py), from the first request
        # added: a full collection set off by the batch's intake walked the whole heap (0.18 s of a 0.9 s run of 256
        # requests on the host proxy; a process that holds another model too, as a benchmark's, walks more).
        bar = tqdm(total=sum(p.n for p in per_prompt), disable=not use_tqdm, desc="generate")
        with frozen_heap():
            try:
                for prompt, p in zip(batch, per_prompt, strict=True):
                    ids, _ = self._prompt_ids(prompt, p.truncate_prompt_tokens)
                    p = _within_context(p, len(ids), max_model_len)
                    rid = str(next(self._ids))
                    result = RequestOutput(rid, prompt.text, ids)
                    results.append(result)
                    for i in range(p.n):
                        child = p.for_sample(i)
                        completion = CompletionOutput(i, "", [], None)
                        result.outputs.append(completion)
                        cid = f"{rid}-{i}" if p.n > 1 else rid
                        self.engine.add_request(cid, ids, child)
                        samples[cid] = _Sample(result, completion, p, [] if p.logprobs is not None else None)
                self._run(samples, bar)
            except BaseException:
                # The batch fails whole (a refused prompt, a failed step, an interrupt): nothing of it is left
                # queued, where the next call's steps would meet it.
                for cid in samples:
                    self.engine.abort(cid)
                raise
            finally:
                bar.close()
        self._fill_logprobs(list(samples.values()))
        return results

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding (prompts as :meth:`generate` takes them), in prompt order: the last token's
        hidden state after the final norm, normalized where the model's directory says so (its sentence-transformers
        ``modules.json``; by default, as vLLM's for a decoder). ``truncate_prompt_tokens``: only the prompt's last this
        many tokens are read (-1: as many as the context holds). ``pooling_params`` (vLLM's): ``dimensions`` cuts a
        Matryoshka model's embeddings (``/v1/embeddings``' rules: ValueError for one it was not trained for),
        ``normalize`` makes them of unit length or not (None: as the model says)."""
        params = pooling_params or PoolingParams()
        dimensions = params.dimensions
        pooling = self.engine.identity.pooling
        if pooling.classifies:
            raise ValueError(f"{self.engine.identity.name} is a classifier: LLM.classify and LLM.score serve it")
        if dimensions is not None and (refusal := pooling.dimensions_refusal(dimensions, self.engine.identity.name)):
            raise ValueError(refusal)
        batch = [self._prompt_ids(_prompt_input(p), truncate_prompt_tokens) for p in _as_batch(prompts)]
        states = self._pooled(batch, lora_request, use_tqdm, "embed")
        vectors = pooling.embeddings([state for _, state in states], dimensions, params.normalize)
        return [
            EmbeddingRequestOutput(rid, ids, EmbeddingOutput(vector), True)
            for (ids, _), (rid, _), vector in zip(batch, states, vectors, strict=True)
        ]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False, lora_request: LoRARequest | None = None
    ) -> list[ClassificationRequestOutput]:
        """vLLM's, for a classifier (``model/classifier.py``): each prompt's labels' probabilities (one label: the
        sigmoid of its logit)."""
        self._classifier(relevance=False)
        batch = [self._prompt_ids(_prompt_input(p), None) for p in _as_batch(prompts)]
        activation = self.engine.identity.pooling.activation
        return [
            ClassificationRequestOutput(rid, ids, ClassificationOutput(scores(v, activation)), True)
            for (ids, _), (rid, v) in zip(batch, self._pooled(batch, lora_request, use_tqdm, "classify"), strict=True)
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's, for a classifier of one label (a cross-encoder, a reranker): the relevance of ``text_1`` to each of
        ``text_2`` (one text, or as many as ``text_2``, paired in order), each pair joined as the tokenizer joins a
        pair."""
        self._classifier(relevance=True)
        pooling = self.engine.identity.pooling
        max_length = truncation_length(truncate_prompt_tokens, self.engine.max_model_len)
        batch: list[tuple[list[int], str | None]] = [
            (pair_ids(self.tokenizer, a, b, pooling.joins_pairs, max_length), None)
            for a, b in score_pairs(text_1, text_2)
        ]
        return [
            ScoringRequestOutput(rid, ids, ScoringOutput(scores(v, pooling.activation)[0]), True)
            for (ids, _), (rid, v) in zip(batch, self._pooled(batch, lora_request, use_tqdm, "score"), strict=True)
        ]

    def _classifier(self, relevance: bool) -> None:
        """Refuse a model that is no classifier (``relevance``: or not one of one label)."""
        identity = self.engine.identity
        if refusal := identity.pooling.scoring_refusal(identity.name, relevance, "LLM.score"):
            raise ValueError(refusal)

    def _prompt_ids(self, prompt: _PromptInput, keep: int | None) -> tuple[list[int], str | None]:
        """A prompt's token ids (its last ``keep``: vLLM's ``truncate_prompt_tokens``) and its cache salt."""
        ids = self.tokenizer.encode(prompt.text) if prompt.ids is None else prompt.ids  # type: ignore[arg-type]
        return truncated_prompt(ids, keep, self.engine.max_model_len), prompt.cache_salt

    def _pooled(
        self, batch: Sequence[tuple[list[int], str | None]], lora: LoRARequest | None, use_tqdm: bool, desc: str
    ) -> list[tuple[str, list[float]]]:
        """Each prompt's request id and pooled state (an embedding, a classifier's logits: ``SamplingParams.embed``),
        in order."""
        params = SamplingParams(temperature=0.0, max_tokens=1, embed=True)
        if lora is not None:
            if lora.lora_name not in self.engine.loras:
                self.engine.add_lora(lora)
            params = dataclasses.replace(params, lora_name=lora.lora_name)
        out: dict[str, list[float] | None] = {}
        bar = tqdm(total=len(batch), disable=not use_tqdm, desc=desc)
        with frozen_heap():
            try:
                for ids, salt in batch:
                    rid = str(next(self._ids))
                    self.engine.add_request(rid, ids, dataclasses.replace(params, cache_salt=salt))
                    out[rid] = None
                while self.engine.has_unfinished():
                    for delta in self.engine.step():
                        if delta.finished:
                            if delta.embedding is None:
                                raise RuntimeError(
                                    f"prompt {delta.request_id} ended without its pooled state: {delta.stop_reason}"
                                )
                            out[delta.request_id] = delta.embedding
                            bar.update(1)
            except BaseException:
                for rid in out:  # (the batch fails whole, as generate's)
                    self.engine.abort(rid)
                raise
            finally:
                bar.close()
        return [(rid, v) for rid, v in out.items() if v is not None]

    def _run(self, samples: dict[str, _Sample], bar: tqdm) -> None:
        """Step the engine until every request is done, filling each one's output from the deltas."""
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                sample = samples[delta.request_id]
                result, completion = sample.result, sample.completion
                completion.text += delta.new_text
                completion.token_ids.extend(delta.new_token_ids)
                if sample.scored is not None:
                    sample.scored.extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None and sample.prompt_scored is None:
                    sample.prompt_scored = delta.prompt_logprobs
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
                    result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
                    result.finished = all(c.finish_reason is not None for c in result.outputs)
                    bar.update(1)

    def _fill_logprobs(self, samples: list[_Sample]) -> None:
        """The batch's logprobs in vLLM's shape, the tokens' texts from one decode for the whole batch."""
        scored = [s for s in samples if s.scored is not None or s.prompt_scored is not None]
        if not scored:
            return
        ids = sorted(
            set().union(
                *(named_tokens([*(s.scored or ()), *(s.prompt_scored or ())]) for s in scored if s.params.detokenize)
            )
        )
        decoded = self.tokenizer.decode_batch([[t] for t in ids], skip_special_tokens=False)
        texts = dict(zip(ids, decoded, strict=True))
        for s in scored:
            named = texts if s.params.detokenize else None
            if s.scored is not None:
                s.completion.logprobs = as_position_logprobs(s.scored, named)  # type: ignore[assignment]
                s.completion.cumulative_logprob = sum(t.logprob or 0.0 for t in s.scored)
            if s.prompt_scored is not None and s.result.prompt_logprobs is None:  # (each of n samples scores it)
                s.result.prompt_logprobs = as_position_logprobs(s.prompt_scored, named)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate; each output's
        ``prompt`` is its conversation's rendered text. Messages take the server's shapes (``api/conversation.py``):
        content as text parts, an assistant turn of tool calls alone; any role and any other key a template reads pass
        as given. ``chat_template``: the name of one of the model's templates, or a template (its text, or a Jinja
        file's path, as ``serve --chat-template`` takes it) instead of the model's; ``chat_template_kwargs``: more
        variables for it, which may also set ``add_generation_prompt`` and ``tools`` (vLLM's). ``sampling_params``: for
        every conversation, or one per conversation (vLLM's). ``continue_final_message`` (vLLM's, with
        ``add_generation_prompt=False``): the last message is continued, not closed (an answer's beginning given for
        the model to go on from)."""
        from boundless.api.conversation import template_conversation  # (pydantic's schemas: loaded when chatting)

        given = {
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template": chat_template,
        }
        if chat_template_kwargs and "tokenize" in chat_template_kwargs:  # (its ids, where the text is encoded here)
            raise ValueError("chat_template_kwargs cannot set 'tokenize'")
        variables = {**given, **(chat_template_kwargs or {})}
        template = variables["chat_template"]
        if template is not None and template not in self.tokenizer.chat_templates:
            variables["chat_template"] = load_chat_template(template)  # (a file's path, or the text checked)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        _check_chat(conversations, tools)
        texts = [
            self.tokenizer.apply_chat_template(template_conversation(conv, strict=False), **variables)  # type: ignore[arg-type]
            for conv in conversations
        ]
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False), "prompt": text}
            for text in texts
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _check_chat(conversations: object, tools: object) -> None:
    """The shapes ``LLM.chat`` takes, refused by name otherwise (a string for a conversation failed inside the
    template's code, a message without a role in Jinja): a conversation is a list of message dicts, each with a
    string ``role`` and ``content`` a string, a list of parts or None; ``tools`` a list of function tools."""
    if not isinstance(conversations, list) or not conversations:
        raise TypeError("messages: a conversation (a list of message dicts) or a list of conversations")
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
            raise TypeError(f"messages: conversation {i} is not a list of message dicts: {conversation!r:.60}")
        for j, message in enumerate(conversation):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}][{j}]: a message needs a role (a string)")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise TypeError(f"messages[{i}][{j}]: content is a string or a list of parts, not {content!r:.40}")
    if tools is not None and not isinstance(tools, list):
        raise TypeError(f"tools: a list of function tools, not {tools!r:.60}")
    for k, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            shape = "{'type': 'function', 'function': {'name': ...}}"
            raise TypeError(f"tools[{k}]: a tool is {shape}, not {tool!r:.60}")


def _within_context(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The params with ``max_tokens`` (and ``min_tokens``) cut to what the context holds after the prompt, as vLLM's
    LLM stops a request there: a prompt that fills the context gets its one token (sampled at its end, never read
    back), whatever ``max_tokens`` (None included). A prompt past the context is left to the engine's refusal."""
    room = max_model_len - prompt_len
    if room < 0:
        return params
    cap = max(room, 1)
    wanted = params.max_tokens
    if (wanted is None and room > 0) or (wanted is not None and wanted <= cap):
        return params  # (None: the engine stops where the context is full)
    return dataclasses.replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        # (bytes were read as token ids, one a byte; None or a number failed inside with no argument named)
        raise TypeError(f"prompts: a prompt or a list of them, not {type(prompts).__name__}")
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [cast("list[int]", items)]  # one prompt given as token ids
    return cast("list[Prompt]", items)  # (prompts, as the type says: an int among them is refused per prompt)


def _prompt_input(prompt: Prompt) -> _PromptInput:
    """One prompt as given; anything else is a clear error (before any request of the batch is queued)."""
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if not keys <= PROMPT_KEYS or not keys & {"prompt", "prompt_token_ids"}:
            raise ValueError(
                "a prompt dict holds 'prompt' (a text) or 'prompt_token_ids', as vLLM's TextPrompt and TokensPrompt, "
                f"and perhaps 'cache_salt'; got keys {sorted(keys)}"
            )
        if prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs"):
            raise ValueError("multi_modal_data: the models served here read text only")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"a prompt dict's 'prompt' is a text, not {text!r:.60}")
        salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            return _PromptInput(text, _token_ids(prompt["prompt_token_ids"]), salt)
        if text is None:
            raise TypeError("a prompt dict's 'prompt' is a text, not None (or give 'prompt_token_ids')")
        return _PromptInput(text, None, salt)
    if isinstance(prompt, str):
        return _PromptInput(prompt, None)
    return _PromptInput(None, _token_ids(prompt))


def _token_ids(prompt: object) -> list[int]:
    # (Ints, not bools: the types, gathered in one pass; not bytes, whose items are ints.)
    if (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (bytes, bytearray))
        and all(issubclass(t, int) and t is not bool for t in set(map(type, prompt)))
    ):
        return list(prompt)
    raise TypeError(f"a prompt is a string, a list of token ids or a prompt dict, not {prompt!r:.60}")
