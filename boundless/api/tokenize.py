"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP.

Agents use them to count a prompt against the context before sending it, or to build prompts as token ids. A
``/tokenize`` body is either a completion's (``prompt``, special tokens added by default) or a chat's (``messages``
and ``tools`` through the chat template, with the generation prompt by default, no special tokens added: the
template writes its own), and the answer is what the completion or chat route would feed the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from boundless.api.errors import APIError
from boundless.api.schemas import Bool, ChatCompletionRequest, Int
from boundless.api.server import encode_text, off_loop_if_large
from boundless.api.validation import require_token_ids, require_valid_text, validated_body

routes = APIRouter()


class TokenizePrompt(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    return_token_strs: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as the chat route takes them


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Int]


@routes.post("/tokenize")
async def tokenize(body: dict[str, Any], request: Request) -> Response:
    server = request.app.state.server
    chat = "messages" in body
    spec = validated_body(TokenizeChat if chat else TokenizePrompt, body)
    require_valid_text(spec.model_dump(by_alias=True))
    if spec.model is not None:
        server.check_model(spec.model)  # (an adapter's name too: it shares the tokenizer)
    return JSONResponse(await off_loop_if_large(request, _tokenized, server, spec, chat))


def _tokenized(server: Any, spec: Any, chat: bool) -> dict[str, Any]:
    """The answer: ``spec``'s tokens, a chat's (``chat``) through the template."""
    tokenizer = server.tokenizer
    if chat:
        fields = {
            "model": spec.model or server.model_name,
            "messages": spec.messages,
            "tools": spec.tools,
            "add_generation_prompt": spec.add_generation_prompt,
            "continue_final_message": spec.continue_final_message,
            "chat_template_kwargs": spec.chat_template_kwargs,
        }
        tokens = server.chat_prompt(validated_body(ChatCompletionRequest, fields))
        if spec.add_special_tokens and tokenizer.bos_token_id is not None:
            tokens = [tokenizer.bos_token_id, *tokens]
    else:
        tokens = encode_text(tokenizer, spec.prompt, add_special_tokens=spec.add_special_tokens)
    return {
        "count": len(tokens),
        "max_model_len": server.client.max_model_len,
        "tokens": tokens,
        "token_strs": tokenizer.convert_ids_to_tokens(tokens) if spec.return_token_strs else None,
    }


@routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    server = request.app.state.server
    if body.model is not None:
        server.check_model(body.model)
    require_token_ids(body.tokens, server.tokenizer.vocab_size, "tokens")
    if not body.tokens:
        raise APIError(400, "tokens must not be empty", "tokens", "invalid_value")
    return JSONResponse({"prompt": server.tokenizer.decode(body.tokens, skip_special_tokens=False)})
