"""Request bodies of the OpenAI-compatible routes, with the extensions vLLM accepts and Autellix's program ids.

Types are strict, as OpenAI's are: an integer field refuses ``5.0`` and ``"5"``, a boolean refuses ``"yes"``, a
number refuses ``NaN``. Limits that only the HTTP edge sets (``n``, ``seed``, penalties, program
id lengths) are here; the sampling ranges that the offline API shares are checked by
:class:`~boundless.engine.sampling_params.SamplingParams`, and what needs the model (vocabulary, text encoding,
context length) by :mod:`boundless.api.validation` and the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from boundless.engine.sampling_params import SEED_MAX, SEED_MIN

MAX_N = 128  # samples per prompt, as OpenAI allows
MAX_ID_CHARS = 256  # program and thread ids: the router keeps them in its process table
MAX_PARENT_THREADS = 64

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = StrictBool
Count = Annotated[int, Strict(), Field(ge=1)]
Seed = Annotated[int, Strict(), Field(ge=SEED_MIN, le=SEED_MAX)]
Penalty = Annotated[float, Strict(), AllowInfNan(False), Field(ge=-2.0, le=2.0)]
Identifier = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]
# The threads of its program a DAG program's call joins (Autellix's ATLAS: it starts where the longest of them ended)
ParentThreads = Annotated[list[Identifier], Field(max_length=MAX_PARENT_THREADS)]
# A tool's name: OpenAI's characters (letters, digits, _ and -) and the separators agents' tool names use (MCP's
# `server.tool`, and `:` and `/`), up to MCP's 128. OpenAI's own rule (64, no separators) refused names that vLLM,
# which checks none, serves.
FunctionName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_.:/-]+$")]

# OpenAI's error code for a tool whose parameters are not an object's schema. The error's type (a validator's
# PydanticCustomError) is the error's code: see errors.VALIDATOR_CODES.
INVALID_FUNCTION_PARAMETERS = "invalid_function_parameters"


class StreamOptions(BaseModel):
    include_usage: Bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens), not only the last
    continuous_usage_stats: Bool = False

    def usage_wanted(self) -> tuple[bool, bool]:
        """Whether a stream ends with a usage chunk, and whether every chunk carries the usage so far."""
        return self.include_usage, self.include_usage and self.continuous_usage_stats


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # (``schema`` is a BaseModel method)
    strict: Bool | None = None


class TagStructure(BaseModel):
    """One part of vLLM's first ``structural_tag`` response format: text from ``begin`` to ``end`` holding JSON under
    ``schema``."""

    model_config = ConfigDict(populate_by_name=True)

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")  # (``schema`` is a BaseModel method)
    end: str


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON under a schema (``json_schema.schema``;
    without one, any JSON object); and vLLM's and SGLang's ``structural_tag``: xgrammar's structural tag (its
    ``format``), or vLLM's first shape of it (``structures`` that begin at one of the ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[TagStructure] | None = None
    triggers: list[Annotated[str, StringConstraints(min_length=1)]] | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and that type needs it")
        tagged = self.format is not None or self.structures is not None
        if (self.type == "structural_tag") != tagged or (self.structures is None) != (self.triggers is None):
            raise ValueError("a structural_tag needs its format (or vLLM's structures and triggers), and only it")
        return self

    def structural_tag(self) -> dict[str, Any]:
        """The structural tag, in xgrammar's shape (vLLM's first shape as its triggered tags)."""
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        tags = []
        for part in self.structures or ():
            content = {"type": "json_schema", "json_schema": part.schema_}
            tags.append({"type": "tag", "begin": part.begin, "content": content, "end": part.end})
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": self.triggers, "tags": tags}}


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` (in ``extra_body``): exactly one of a JSON schema (``json``, an object or its
    text), a regular expression, a list of choices, an EBNF grammar, ``json_object``, or a structural tag."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # (``json`` is a BaseModel method)
    regex: str | None = None
    choice: Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: Bool | None = None
    structural_tag: dict[str, Any] | str | None = None  # xgrammar's structural tag, or its JSON text (vLLM's)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [self.json_, self.regex, self.choice, self.grammar, self.json_object or None, self.structural_tag]
        if sum(v is not None for v in given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object and structural_tag")
        return self


class NullIsDefault(BaseModel):
    """A request body whose optional fields take their defaults when sent as ``null``: OpenAI's API marks ``n``,
    ``stream``, ``logprobs``, ``echo`` and the like nullable, and vLLM types them ``Optional`` alike. A required
    field sent as ``null`` is still refused."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        nulls = {
            k
            for k, v in data.items()
            if v is None and k in fields and not fields[k].is_required() and fields[k].default is not None
        }
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data


class _SamplingFields(NullIsDefault):
    """Fields shared by chat and completions; unknown fields are accepted and ignored, as OpenAI does."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    temperature: Float | None = None
    top_p: Float | None = None
    max_tokens: Count | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # (on completions too, as vLLM takes it)
    structured_outputs: StructuredOutputsParams | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Token ids (as strings, OpenAI's JSON keys) to biases in [-100, 100]; the ids are checked against the vocabulary.
    logit_bias: dict[str, Annotated[float, Strict(), AllowInfNan(False), Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    # Only these tokens may be sampled (checked against the vocabulary); words the output may not hold
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    # Logprobs' tokens as ``token_id:<id>``, for clients that need the ids (a token's text may be no whole character);
    # None: as the server's --return-tokens-as-token-ids says
    return_tokens_as_token_ids: Bool | None = None
    # vLLM's: the prompt's token ids and each choice's output's come with the response (streamed: as they go out)
    return_token_ids: Bool = False
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    # Each prompt token's logprob given the tokens before it, with this many alternatives (not -1, the vocabulary)
    prompt_logprobs: Annotated[int, Strict(), Field(ge=0)] | None = None
    # vLLM's: the prefix cache shares KV only among requests with the same salt (multi-tenant privacy)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's: a class of service, smaller first; the scheduler's policy orders requests within one
    priority: Int = 0
    # vLLM's: the prompt keeps its last this many tokens (-1: as many as the context holds), for a history grown long
    truncate_prompt_tokens: Annotated[int, Strict(), Field(ge=-1)] | None = None
    # Autellix program identity (also accepted as X-Program-Id / X-Thread-Id headers)
    program_id: Identifier | None = None
    thread_id: Identifier | None = None
    parent_thread_ids: ParentThreads | None = None
    # OpenAI's: requests that share it share cached prefixes (Codex sends its conversation's id). Here it names the
    # program the request belongs to unless program_id or X-Program-Id does: the same scheduling and locality.
    prompt_cache_key: str | None = None  # (one that cannot be a program id is ignored: api/agent_sessions.py)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any]  # JSON text as OpenAI sends it; an object is accepted too


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None  # parts are checked by part_texts
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


def object_schema(parameters: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
    """A function's ``parameters`` (a field validator's value, validated after the function's ``name``), which must
    be an object's schema, as OpenAI's must: a call's arguments are a JSON object, and a forced call's grammar writes
    what the schema allows. ``{}`` passes, as leaving them out does (no parameters)."""
    if parameters and parameters.get("type") != "object":
        raise PydanticCustomError(
            INVALID_FUNCTION_PARAMETERS,
            f"Invalid schema for function '{info.data.get('name', '')}': schema must be a JSON Schema of "
            f"'type: \"object\"', got 'type: \"{parameters.get('type')}\"'.",
        )
    properties = (parameters or {}).get("properties")
    if properties is not None and not (
        isinstance(properties, dict) and all(isinstance(s, (dict, bool)) for s in properties.values())
    ):
        # (A list or a string here was read as the parameters' schemas when the route typed a call's values: a 500.)
        raise PydanticCustomError(
            INVALID_FUNCTION_PARAMETERS,
            f"Invalid schema for function '{info.data.get('name', '')}': 'properties' must be an object whose "
            "values are schemas (objects or booleans).",
        )
    return parameters


def check_distinct_names(names: list[str]) -> None:
    """Refuse tools of the same name (ValueError): a call names its function, so each tool's must be its own."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"two tools are named {name!r}: each function's name must be unique")
        seen.add(name)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None  # calls held to ``parameters`` under tool_choice auto too (api/strict_calls.py)

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        return object_schema(parameters, info)


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as a chat template reads them, as vLLM hands them over (its ``model_dump``): a function's description
    and parameters there even when null (a template that writes each tool's JSON writes them: Llama 3.1's), ``strict``
    only when given (vLLM's schema has no such field), other keys as sent."""
    out = []
    for tool in tools:
        dumped = tool.model_dump()
        if dumped["function"].get("strict") is None:
            del dumped["function"]["strict"]
        out.append(dumped)
    return out


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]  # OpenAI's
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)


class PredictionText(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs (``prediction``): text the answer is likely to hold, as a string or text parts."""

    type: Literal["content"]
    content: str | list[PredictionText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True  # false: at most one call (held to one with `required`, the first kept else)
    add_generation_prompt: Bool = True
    # vLLM's: the last message (an assistant's) is continued, not closed: an answer's beginning given for the model
    continue_final_message: Bool = False
    # vLLM's: more variables for the chat template (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    # With --reasoning-parser: OpenAI's effort, passed to the template as vLLM does; whether to return the reasoning
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: Bool = True
    # OpenAI's Predicted Outputs: drafts for speculative decoding; the answer is the same, sooner
    prediction: Prediction | None = None
    # vLLM's, with --reasoning-parser: the thinking closes (its end tag forced) after this many tokens
    thinking_token_budget: Annotated[int, Strict(), Field(ge=0)] | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        check_distinct_names([t.function.name for t in tools or ()])
        return tools


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None  # 0 only with echo: the prompt alone (as vLLM)
    logprobs: Int | None = None
    echo: Bool = False
    suffix: str | None = None
    # OpenAI's: best_of candidates, the n with the highest logprob per token returned. Only best_of == n is served
    # (vLLM's V1 engine takes only that too); more is refused by the route, not dropped.
    best_of: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One message for every wrong shape, rather than one per branch of the union.
        if isinstance(v, str) or (
            isinstance(v, list)
            and (
                all(isinstance(x, str) for x in v)
                or all(_is_int(x) for x in v)
                or all(isinstance(x, list) and all(_is_int(t) for t in x) for x in v)
            )
        ):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids, or a list of lists of token ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


ROLES = ("system", "developer", "user", "assistant", "tool")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class InvalidContentPart(ValueError):
    """A part of a message's content that cannot be used; ``index`` is its position in the list."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


# Between a message's text parts: vLLM joins them so (its chat_utils), and a template then reads them as one text.
TEXT_PART_SEPARATOR = "\n"


# The content parts read as text, and the key each holds its text under: vLLM's (the Responses API's input_text and
# output_text, sent back in a chat; an assistant's refusal).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def part_texts(content: list[dict[str, Any]]) -> list[str]:
    """The texts of a list of content parts (:data:`TEXT_PARTS`), each a string (a part without one is refused, as
    OpenAI refuses it). Any other part is an :class:`InvalidContentPart`."""
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise InvalidContentPart(i, f"content parts of type {part.get('type')!r} are not supported")
        text = part.get(key)
        if not isinstance(text, str):
            raise InvalidContentPart(i, f"a {part['type']} part needs a string {key!r}")
        texts.append(text)
    return texts
