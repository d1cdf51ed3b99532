"""The offline API: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.logprobs import PromptLogprobs, SampledToken
from boundless.engine.sampling_params import RequestOutputKind, SamplingParams
from boundless.gc_quiet import frozen_heap
from boundless.model.loader import LoadedModel, load_configured_model
from boundless.model.lora import LoRARequest
from boundless.model.tokenizer import load_chat_template

# A text, token ids, or vLLM's prompt dicts: ``{"prompt": text}`` (TextPrompt), ``{"prompt_token_ids": ids}``
# (TokensPrompt).
Prompt = str | list[int] | Mapping[str, Any]


@dataclass
class CompletionOutput:
    """One sampled continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[SampledToken] | None = None  # per generated token, when asked for

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(t.logprob or 0.0 for t in self.logprobs)


@dataclass
class RequestOutput:
    """A prompt and its ``n`` completions; with ``SamplingParams.prompt_logprobs``, each prompt token's logprob given
    the tokens before it (None for the first), as vLLM's ``RequestOutput.prompt_logprobs``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None


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
    ``num_kv_blocks``, ``enable_prefix_caching``, ``max_num_batched_tokens``, ...).
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        self._start(engine_config(model, **kwargs), None)

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel | None = None) -> LLM:
        """An LLM from a full config; ``loaded`` reuses a model already in memory (tests, benchmarks)."""
        llm = cls.__new__(cls)
        llm._start(config, loaded)
        return llm

    def _start(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        if loaded is None:
            loaded = load_configured_model(config.model)
        self.engine = EngineCore.from_model(loaded, config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Finish the writes to the disk store (``kv_disk_path``), so that the next process finds every block."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or vLLM's ``{"prompt": ...}`` or
        ``{"prompt_token_ids": [...]}``); results come in prompt order. ``lora_request``
        (vLLM's): the LoRA adapter to run with, for every prompt or one per prompt (``enable_lora=True``); it is
        loaded on first use (a name already loaded runs with the adapter loaded under it). ``priority`` (vLLM's): each
        prompt's class of service, smaller first (``SamplingParams.priority``)."""
        batch = [_prompt_input(p) for p in _as_batch(prompts)]
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(per_prompt)} sampling params")
        if priority is not None:
            if len(priority) != len(batch):
                raise ValueError(f"{len(batch)} prompts but {len(priority)} priorities")
            per_prompt = [dataclasses.replace(p, priority=rank) for p, rank in zip(per_prompt, priority, strict=True)]
        loras = [lora_request] * len(batch) if not isinstance(lora_request, Sequence) else list(lora_request)
        if len(loras) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(loras)} LoRA requests")
        for i, lora in enumerate(loras):
            if lora is not None:
                if lora.lora_name not in self.engine.loras:  # (one loaded already is used as it is)
                    self.engine.add_lora(lora)
                per_prompt[i] = dataclasses.replace(per_prompt[i], lora_name=lora.lora_name)
        # The outputs are read when the batch is done (as vLLM's LLM does): each text is decoded once, at its end.
        # (Made once for each params object given: a batch's prompts most often share one.)
        given = {id(p): p for p in per_prompt}
        final = {key: dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for key, p in given.items()}
        per_prompt = [final[id(p)] for p in per_prompt]
        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        # The collector's full walks skip the model and the engine (boundless/gc_quiet.py), from the first request
        # added: a full collection set off by the batch's intake walked the whole heap (0.18 s of a 0.9 s run of 256
        # requests on the host proxy; a process that holds another model too, as a benchmark's, walks more).
        bar = tqdm(total=sum(p.n for p in per_prompt), disable=not use_tqdm, desc="generate")
        with frozen_heap():
            try:
                for prompt, p in zip(batch, per_prompt, strict=True):
                    ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                    rid = str(next(self._ids))
                    result = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids)
                    results.append(result)
                    for i in range(p.n):
                        child = p.for_sample(i)
                        completion = CompletionOutput(i, "", [], None, logprobs=[] if p.logprobs is not None else None)
                        result.outputs.append(completion)
                        cid = f"{rid}-{i}" if p.n > 1 else rid
                        self.engine.add_request(cid, ids, child)
                        children[cid] = (result, completion)
                self._run(children, bar)
            except BaseException:
                # The batch fails whole (a refused prompt, a failed step, an interrupt): nothing of it is left
                # queued, where the next call's steps would meet it.
                for cid in children:
                    self.engine.abort(cid)
                raise
            finally:
                bar.close()
        return results

    def _run(self, children: dict[str, tuple[RequestOutput, CompletionOutput]], bar: tqdm) -> None:
        """Step the engine until every request is done, filling each one's output from the deltas."""
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                result, completion = children[delta.request_id]
                completion.text += delta.new_text
                completion.token_ids.extend(delta.new_token_ids)
                if completion.logprobs is not None:
                    completion.logprobs.extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None and result.prompt_logprobs is None:  # (each of n samples scores)
                    result.prompt_logprobs = delta.prompt_logprobs
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
                    result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
                    bar.update(1)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate. Messages take the
        server's shapes (``api/conversation.py``): content as text parts, an assistant turn of tool calls alone; any
        role and any other key a template reads pass as given. ``chat_template``: the name of one of the model's
        templates, or a template (its text, or a Jinja file's path, as ``serve --chat-template`` takes it) instead of
        the model's; ``chat_template_kwargs``: more variables for it, which may also set ``add_generation_prompt`` and
        ``tools`` (vLLM's). ``params``: for every conversation, or one per conversation (vLLM's).
        ``continue_final_message`` (vLLM's, with ``add_generation_prompt=False``): the last message is continued, not
        closed (an answer's beginning given for the model to go on from)."""
        from boundless.api.conversation import template_conversation  # (pydantic's schemas: loaded when chatting)

        given = {
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template": chat_template,
        }
        variables = {**given, **(chat_template_kwargs or {})}
        template = variables["chat_template"]
        if template is not None and template not in self.tokenizer.chat_templates:
            variables["chat_template"] = load_chat_template(template)  # (a file's path, or the text checked)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    template_conversation(conv, strict=False),  # type: ignore[arg-type]
                    **variables,
                ),
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _prompt_input(prompt: Prompt) -> str | list[int]:
    """One prompt as a text or as token ids; anything else is a clear error (before any request of the batch is
    queued)."""
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if len(keys) != 1 or not keys <= {"prompt", "prompt_token_ids"}:
            raise ValueError(
                f"a prompt dict holds 'prompt' (a text) or 'prompt_token_ids', as vLLM's TextPrompt and TokensPrompt;"
                f" got keys {sorted(keys)}"
            )
        prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if isinstance(prompt, str):
        return prompt
    # (Ints, not bools: the types, gathered in one pass.)
    if isinstance(prompt, Sequence) and all(issubclass(t, int) and t is not bool for t in set(map(type, prompt))):
        return list(prompt)
    raise TypeError(f"a prompt is a string, a list of token ids or a prompt dict, not {prompt!r:.60}")
