"""vLLM's routes for a classifier (``model/classifier.py``): ``POST /classify`` (each input's labels' probabilities),
``POST /score`` and ``/v1/score`` (pairs of texts, a relevance each), ``POST /rerank``, ``/v1/rerank`` and
``/v2/rerank`` (documents ordered by their relevance to a query: Jina's and Cohere's shape).

Each input, or each pair (joined as the tokenizer joins a pair: ``Tokenizer.encode_pair``), is one engine request whose
pooled state goes through the classifier's head (``ModelRunner``) in the engine's batches, as embeddings do
(``api/embeddings.py``). A relevance is the sigmoid of the one label's logit; classes' probabilities, the softmax.
An agent reranks what it retrieved with the same server that answers it.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from boundless.api.embeddings import PoolingRequest, input_prompts, listed_response, pooled, received, served_pooling
from boundless.api.errors import APIError
from boundless.api.schemas import Bool, Int
from boundless.api.server import off_loop_if_large
from boundless.engine.sampling_params import truncation_length
from boundless.model.classifier import pair_ids, score_pairs, scores
from boundless.model.pooling import EmbeddingPooling

routes = APIRouter()


class ScoreRequest(BaseModel):
    """vLLM's: ``text_1`` against each of ``text_2`` (one text, or as many as ``text_2``, paired in order); newer vLLM
    names them ``queries`` and ``documents``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: Int | None = None


class RerankRequest(BaseModel):
    """Jina's and Cohere's: ``documents`` by relevance to ``query``, the first ``top_n`` (0 or none: all)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: str | list[str]
    top_n: Int | None = None
    return_documents: Bool = True
    truncate_prompt_tokens: Int | None = None


def _served(request: Request, body: BaseModel, relevance: bool) -> tuple[Any, str | None, EmbeddingPooling]:
    """A scoring request's server, the LoRA adapter its ``model`` names, and the served classifier (a 400 for a model
    that is none; ``relevance``: it must have one label)."""
    server, model, lora = received(request, body)
    pooling = served_pooling(server)
    if refusal := pooling.scoring_refusal(model, relevance, "/score and /rerank"):
        raise APIError(400, refusal, "model")
    return server, lora, pooling


def _pairs(
    server: Any, pooling: EmbeddingPooling, pairs: list[tuple[str, str]], keep: int | None, field: str
) -> list[list[int]]:
    """Each pair's token ids (``classifier.pair_ids``), at most ``keep`` (-1: the context) where given (vLLM's
    ``truncate_prompt_tokens``: a pair's longer text loses its last tokens first, the query stays)."""
    max_length = truncation_length(keep, server.client.max_model_len)
    prompts = [pair_ids(server.tokenizer, a, b, pooling.joins_pairs, max_length) for a, b in pairs]
    if any(not ids for ids in prompts):
        raise APIError(400, "a text pair must not be empty", field)
    return prompts


@routes.post("/classify")
async def classify(body: PoolingRequest, request: Request) -> Response:
    server, lora, pooling = _served(request, body, relevance=False)
    prompts = await off_loop_if_large(
        request, input_prompts, server, body.input, body.add_special_tokens, body.truncate_prompt_tokens
    )
    rid = f"classify-{uuid.uuid4().hex}"
    data = []
    for index, logits in enumerate(await pooled(server, rid, prompts, lora, request)):
        probs = scores(logits, pooling.activation)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": pooling.labels[best], "probs": probs, "num_classes": len(probs)})
    return listed_response(rid, body.model or server.model_name, data, prompts)


@routes.post("/score")
@routes.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> Response:
    server, lora, pooling = _served(request, body, relevance=True)
    firsts = body.text_1 if body.text_1 is not None else body.queries
    seconds = body.text_2 if body.text_2 is not None else body.documents
    if firsts is None or seconds is None:
        raise APIError(400, "give text_1 and text_2 (or queries and documents)", "text_1")
    try:
        pairs = score_pairs(firsts, seconds)
    except ValueError as e:
        raise APIError(400, str(e), "text_1") from None
    prompts = await off_loop_if_large(request, _pairs, server, pooling, pairs, body.truncate_prompt_tokens, "text_1")
    rid = f"score-{uuid.uuid4().hex}"
    relevances = [scores(v, pooling.activation)[0] for v in await pooled(server, rid, prompts, lora, request)]
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(relevances)]
    return listed_response(rid, body.model or server.model_name, data, prompts)


@routes.post("/rerank")
@routes.post("/v1/rerank")
@routes.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    server, lora, pooling = _served(request, body, relevance=True)
    documents = [body.documents] if isinstance(body.documents, str) else body.documents
    if not documents:
        raise APIError(400, "documents must not be empty", "documents")
    pairs = [(body.query, document) for document in documents]
    keep = body.truncate_prompt_tokens
    prompts = await off_loop_if_large(request, _pairs, server, pooling, pairs, keep, "documents")
    rid = f"rerank-{uuid.uuid4().hex}"
    relevances = [scores(v, pooling.activation)[0] for v in await pooled(server, rid, prompts, lora, request)]
    # (top_n: that many first; none, 0 or below 0, all of them, as vLLM takes it.)
    top = body.top_n if body.top_n is not None and body.top_n > 0 else None
    order = sorted(range(len(relevances)), key=lambda i: -relevances[i])[:top]
    results = [
        {"index": i, "relevance_score": relevances[i]}
        | ({"document": {"text": documents[i]}} if body.return_documents else {})
        for i in order
    ]
    tokens = sum(len(p) for p in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"id": rid, "model": body.model or server.model_name, "usage": usage, "results": results})
