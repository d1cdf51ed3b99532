"""OpenAI's ``POST /v1/embeddings``: a text's (or token ids') embedding from the served model, as vLLM serves it.

Each input is one engine request (``SamplingParams.embed``): its prompt is computed as a completion's is (batched with
the others, in chunks, from the prefix cache), and its last token's hidden state after the final norm, pooled as the
model's directory says (``model/pooling.py``: normalized to unit length by default), is its embedding. Agents embed
their memories and documents with the same server that answers them (an embedding model, Qwen3-Embedding's shape, or
any causal LM the server runs). ``dimensions`` cuts a Matryoshka model's embedding to its first ``dimensions`` values
(normalized again), as vLLM does; a model that does not say it is one is refused it. ``encoding_format`` ``base64``
sends each embedding as the base64 of its little-endian float32 bytes, as OpenAI's does.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from boundless.api.errors import APIError
from boundless.api.schemas import Bool, Int
from boundless.api.server import encode_text, off_loop_if_large
from boundless.api.validation import require_token_ids, require_valid_text
from boundless.engine.sampling_params import SamplingParams, truncated_prompt
from boundless.model.pooling import EmbeddingPooling

routes = APIRouter()


class PoolingRequest(BaseModel):
    """vLLM's ``/pooling`` (and ``/classify``'s): inputs, with vLLM's ``truncate_prompt_tokens`` and
    ``add_special_tokens``, and for an embedding model ``dimensions`` (Matryoshka) and ``normalize`` (None: as the model
    says)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    truncate_prompt_tokens: Int | None = None
    add_special_tokens: Bool = True
    dimensions: Int | None = None
    normalize: Bool | None = None


class EmbeddingRequest(PoolingRequest):
    """OpenAI's body (``input``: a text, texts, token ids, or lists of token ids; ``user`` is accepted and unused),
    with vLLM's fields (:class:`PoolingRequest`)."""

    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


@routes.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    server, model, lora = received(request, body)
    pooling = served_pooling(server)
    if pooling.classifies:
        raise APIError(400, f"{model!r} is a classifier: it serves /classify, /score and /rerank", "model")
    rid = f"embd-{uuid.uuid4().hex}"
    prompts, vectors = await _embedded(server, pooling, model, lora, rid, body, request)
    data = []
    for index, values in enumerate(vectors):
        vector = np.asarray(values, dtype=np.float32)
        embedding: Any = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
            else vector.tolist()
        )  # fmt: skip
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return listed_response(rid, model, data, prompts)


@routes.post("/pooling")
async def pooling_route(body: PoolingRequest, request: Request) -> Response:
    """The engine's pooled states: an embedding model's as ``/v1/embeddings`` makes them (``dimensions``,
    ``normalize``), a classifier's logits as they are."""
    server, model, lora = received(request, body)
    pooling = served_pooling(server)
    rid = f"pool-{uuid.uuid4().hex}"
    if pooling.classifies:
        prompts = await off_loop_if_large(
            request, input_prompts, server, body.input, body.add_special_tokens, body.truncate_prompt_tokens
        )
        states = await pooled(server, rid, prompts, lora, request)
    else:
        prompts, states = await _embedded(server, pooling, model, lora, rid, body, request)
    data = [{"index": i, "object": "pooling", "data": state} for i, state in enumerate(states)]
    return listed_response(rid, model, data, prompts)


async def _embedded(
    server: Any, pooling: EmbeddingPooling, model: str, lora: str | None, rid: str, body: PoolingRequest,
    request: Request,
) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
    """An embedding request's prompts and their embeddings (``EmbeddingPooling.embeddings``: cut to ``dimensions``,
    of unit length as the model says or the request asks)."""
    if body.dimensions is not None and (refusal := pooling.dimensions_refusal(body.dimensions, model)):
        raise APIError(400, refusal, "dimensions", "invalid_value")
    prompts = await off_loop_if_large(
        request, input_prompts, server, body.input, body.add_special_tokens, body.truncate_prompt_tokens
    )
    states = await pooled(server, rid, prompts, lora, request)
    try:
        return prompts, pooling.embeddings(states, body.dimensions, body.normalize)
    except ValueError as e:
        raise APIError(400, str(e), "dimensions", "invalid_value") from None


def received(request: Request, body: BaseModel) -> tuple[Any, str, str | None]:
    """A pooling route's server, the model its body names (vLLM's: the served one when it names none) and the LoRA
    adapter that is (404 for a model not served; 400 for text that is not Unicode)."""
    server = request.app.state.server
    require_valid_text(body.model_dump())
    model = getattr(body, "model", None) or server.model_name
    return server, model, server.check_model(model)


def listed_response(rid: str, model: str, data: list[dict[str, Any]], prompts: list[list[int]]) -> JSONResponse:
    """A list response (OpenAI's embeddings', vLLM's ``/pooling``, ``/score`` and ``/classify``), with its prompts'
    tokens as its usage."""
    tokens = sum(len(p) for p in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse(
        {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data, "usage": usage}
    )


def served_pooling(server: Any) -> EmbeddingPooling:
    """How the served model pools (400 where it serves none: prefill and decode engines, a pooling not served)."""
    pooling = server.client.pooling
    if pooling is None:
        raise APIError(
            400, "pooling requests are not served by prefill and decode engines; serve the model alone", "model"
        )
    if not pooling.served:
        raise APIError(400, pooling.refusal(), "model")
    return pooling


async def pooled(
    server: Any, rid: str, prompts: list[list[int]], lora: str | None, request: Request
) -> list[list[float]]:
    """Each prompt's pooled state (an embedding, or a classifier's logits) from the engine (``SamplingParams.embed``),
    in order. In waves of at most the requests one engine lets wait: an embedding client sends its documents a thousand
    at a time (OpenAI takes 2,048 inputs), more than --max-waiting (512), which refuses more samples than it holds."""
    served_pooling(server)
    params = SamplingParams(temperature=0.0, max_tokens=1, embed=True, lora_name=lora)
    wave = server.client.max_waiting or len(prompts)
    out: list[list[float]] = []
    for start in range(0, len(prompts), wave):
        # (prompt_only: the one token sampled after a prompt goes nowhere, so a prompt may fill the context.)
        streams = await server.submit(f"{rid}-{start}", prompts[start : start + wave], params, None, prompt_only=True)
        for choice in await server.collect(streams, request):
            if choice.embedding is None:
                raise APIError(500, f"input {len(out)} ended without its pooled state ({choice.stop_reason})", "input")
            out.append(choice.embedding)
    return out


def input_prompts(server: Any, given: Any, add_special_tokens: bool, keep: int | None) -> list[list[int]]:
    """Each input's token ids (a text, texts, token ids or lists of them: texts tokenized as a completion's prompt is;
    ids checked against the vocabulary), the last ``keep`` of each where given (vLLM's ``truncate_prompt_tokens``)."""
    if isinstance(given, str):
        prompts = [encode_text(server.tokenizer, given, add_special_tokens)]
    elif given and all(isinstance(x, int) for x in given):
        prompts = [list(given)]
    elif given and all(isinstance(x, str) for x in given):
        prompts = [encode_text(server.tokenizer, x, add_special_tokens) for x in given]
    elif given and all(isinstance(x, list) for x in given):
        prompts = [list(x) for x in given]
    else:
        raise APIError(400, "input must not be empty", "input")
    if any(not ids for ids in prompts):
        raise APIError(400, "input must not be empty (nor any of its texts or token lists)", "input")
    for ids in prompts:
        require_token_ids(ids, server.tokenizer.vocab_size, "input")
    return [truncated_prompt(ids, keep, server.client.max_model_len) for ids in prompts]
