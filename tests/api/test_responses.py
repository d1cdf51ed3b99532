"""OpenAI's Responses API on a real server and the real `openai` client: a response is the chat completion of its
conversation (the same greedy tokens), chains continue the stored conversation as one program, streamed events
come in OpenAI's order and add up to the response, function calls round-trip, and bad input is a 4xx naming the
field (tests/api/test_bad_input.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from served_models import Served, serve_hermes

from boundless.api.responses import ResponseStore, StoredResponse

MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Rome", "Paris"]}},
            "required": ["city"],
        },
    }
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}},
]


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(tmp_path_factory.mktemp("hermes")) as served:
        yield served


@pytest.fixture(scope="module")
def client(hermes: Served) -> openai.OpenAI:
    return hermes.client


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs).choices[0]


def test_a_response_is_the_chat_completion_of_its_conversation(client: openai.OpenAI, hermes: Served) -> None:
    first = client.responses.create(
        model=MODEL, input="Name a color.", instructions="Answer in one word.", max_output_tokens=12, temperature=0
    )
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert first.output_text == chat.choices[0].message.content
    assert first.usage is not None and chat.usage is not None
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == chat.usage.completion_tokens
    assert (first.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    assert first.output[0].type == "message" and first.output[0].role == "assistant"

    # A chained response continues the stored conversation (not its instructions, as OpenAI's does not).
    second = client.responses.create(
        model=MODEL, input="Another one?", previous_response_id=first.id, max_output_tokens=12, temperature=0
    )
    messages = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another one?"},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and second.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert second.previous_response_id == first.id

    # The chain is one program to the scheduler, named by its first response; the chat calls were programs alone.
    record = hermes.engine.core.policy.table.get(first.id)  # type: ignore[attr-defined]
    assert record is not None and record.completed_calls == 2
    assert hermes.engine.core.policy.table.get(second.id) is None  # type: ignore[attr-defined]
    # OpenAI's prompt_cache_key (Codex's conversation id) names the chain's program instead.
    keyed = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, prompt_cache_key="conv-7")
    client.responses.create(model=MODEL, input="More", previous_response_id=keyed.id, max_output_tokens=2)
    record = hermes.engine.core.policy.table.get("conv-7")  # type: ignore[attr-defined]
    assert record is not None and record.completed_calls == 2

    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_text_parts_reach_the_template_joined_by_newlines(client: openai.OpenAI) -> None:
    """An input message's text parts are joined by newlines, as the chat route joins a message's parts (and vLLM
    both); they were joined with nothing between."""
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]
    response = client.responses.create(model=MODEL, input=[{"role": "user", "content": parts}], max_output_tokens=1)

    def chat_prompt_tokens(text: str) -> int:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1)
        assert chat.usage is not None
        return chat.usage.prompt_tokens

    assert chat_prompt_tokens("Hellothere") != chat_prompt_tokens("Hello\nthere")  # (the two prompts tell apart)
    assert response.usage is not None and response.usage.input_tokens == chat_prompt_tokens("Hello\nthere")


def test_stored_responses_are_kept_found_and_deleted(client: openai.OpenAI) -> None:
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert client.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unkept.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    # Its input items, as the client lists them (a string input: one user message), newest first, a page at a time.
    (item,) = client.responses.input_items.list(kept.id)
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Hi"  # type: ignore[union-attr]
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    three = client.responses.create(model=MODEL, input=turns, max_output_tokens=1)
    page = client.responses.input_items.list(three.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["Bye", "Hello"] and page.has_more  # type: ignore[union-attr]
    rest = client.responses.input_items.list(three.id, limit=2, after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Hi"] and not rest.has_more  # type: ignore[union-attr]
    # ``before`` an item: the page just before it (the previous page), as OpenAI's cursors page back.
    cursor = {"limit": 1, "before": rest.data[0].id}
    back = client.get(f"/responses/{three.id}/input_items", options={"params": cursor}, cast_to=object)
    assert [i["content"][0]["text"] for i in back["data"]] == ["Hello"] and back["has_more"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:  # a URL parameter's error names it
        client.get(f"/responses/{three.id}/input_items", options={"params": {"limit": "abc"}}, cast_to=object)
    assert bad.value.body["param"] == "limit" and bad.value.body["message"].startswith("limit:")  # type: ignore[index]
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_the_store_keeps_the_latest_responses() -> None:
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, [], "p"))
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    assert store.delete("r1") and not store.delete("r1")


def test_streamed_events_come_in_order_and_add_up_to_the_response(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=16, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas and deltas == final.output_text
    assert kinds[-1] == f"response.{final.status}"
    if final.status == "incomplete":
        assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    unstreamed = client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=16, temperature=0)
    assert unstreamed.output_text == deltas


def test_a_function_call_round_trips(client: openai.OpenAI) -> None:
    choice = {"type": "function", "name": "get_weather"}
    asked: dict[str, Any] = {"model": MODEL, "input": "Weather in Rome?", "tools": TOOLS, "temperature": 0}
    response = client.responses.create(**asked, tool_choice=choice)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    # The same call as the chat route forced alike makes.
    chat = _chat(
        client,
        [{"role": "user", "content": "Weather in Rome?"}],
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert json.loads(call.arguments) == json.loads(chat.message.tool_calls[0].function.arguments)

    # Streamed: the call comes whole once the output is parsed, in OpenAI's events.
    events = list(client.responses.create(**asked, tool_choice=choice, stream=True))
    assert [e.type for e in events][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (streamed,) = events[-1].response.output  # type: ignore[union-attr]
    assert streamed.arguments == call.arguments and events[3].delta == call.arguments  # type: ignore[union-attr]

    # The call's output, chained: the model reads the whole exchange (the chat route given it alike agrees).
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[output],
        tools=TOOLS,
        max_output_tokens=8,
        temperature=0,
    )
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"},
    ]
    chat = _chat(client, messages, tools=CHAT_TOOLS, max_tokens=8)
    assert answer.output_text == (chat.message.content or "")
    (listed,) = client.responses.input_items.list(answer.id)
    assert (listed.type, listed.call_id, listed.output) == ("function_call_output", call.call_id, "Sunny, 24 C")  # type: ignore[union-attr]


def test_truncation_auto_drops_the_oldest_turns_to_fit(client: openai.OpenAI, hermes: Served) -> None:
    turn = " ".join(["word"] * 100)  # 400 tokens for the random model's tokenizer
    assert len(hermes.loaded.tokenizer.encode(turn)) == 400
    asked: dict[str, Any] = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(**asked, input=turn + " one")
    second = client.responses.create(**asked, input=turn + " two", previous_response_id=first.id)
    # The chain's conversation is the same text again: its first turn's KV is found in the prefix cache.
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= 384
    third: dict[str, Any] = {**asked, "input": turn + " three", "previous_response_id": second.id}
    with pytest.raises(openai.BadRequestError) as info:  # three turns do not fit the 1,024-token context
        client.responses.create(**third)
    assert info.value.body["param"] == "input"  # type: ignore[index]  (alone past the context: as chat names its prompt)
    cut = client.responses.create(**third, truncation="auto")
    assert cut.truncation == "auto"
    # The first turn is dropped, no more: the chat route given the last two turns reads the same prompt.
    messages = [
        {"role": "user", "content": turn + " two"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": turn + " three"},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert cut.usage is not None and chat.usage is not None
    assert cut.usage.input_tokens == chat.usage.prompt_tokens and cut.output_text == chat.choices[0].message.content


def test_with_tools_a_text_answer_streams_as_it_is_made(client: openai.OpenAI) -> None:
    asked: dict[str, Any] = {"model": MODEL, "input": "Hi", "tools": TOOLS, "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**asked)
    assert [o.type for o in whole.output] == ["message"]  # a random model's text parses as no call
    events = list(client.responses.create(**asked, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 5  # not held to the end
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text  # type: ignore[union-attr]


def test_the_messages_logprobs_are_its_texts_tokens(client: openai.OpenAI) -> None:
    """``message.output_text.logprobs`` are the message's text's tokens' alone, not the function call's: the deltas'
    together, the ``output_text.done`` event's and the final message's are the same list, and the unstreamed
    message's."""
    said = 'Ok. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    asked: dict[str, Any] = {
        "model": MODEL,
        "input": "Weather in Rome?",
        "tools": TOOLS,
        "max_output_tokens": 200,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "extra_body": {"structured_outputs": {"regex": re.escape(said).replace("\\ ", " ")}},
    }
    whole = client.responses.create(**asked)
    assert [o.type for o in whole.output] == ["message", "function_call"] and whole.output_text == "Ok."
    tokens = [lp.token for lp in whole.output[0].content[0].logprobs]
    assert "".join(tokens) == "Ok."
    events = list(client.responses.create(**asked, stream=True))
    deltas = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [[lp.token for lp in e.logprobs] for e in events if e.type == "response.output_text.done"]
    final = [lp.token for lp in events[-1].response.output[0].content[0].logprobs]  # type: ignore[union-attr]
    assert deltas == done == final == tokens


def test_text_format_holds_the_output_to_a_schema(client: openai.OpenAI) -> None:
    # (A random model's output: only the grammar makes it JSON.)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}
    response = client.responses.create(
        model=MODEL,
        input="A color as JSON",
        text={"format": {"type": "json_schema", "name": "color", "schema": schema}},
        max_output_tokens=200,
        temperature=0,
    )
    assert json.loads(response.output_text)["color"] in ("red", "blue")
    assert response.text is not None and response.text.format.type == "json_schema"


def _said(output: list[Any]) -> list[tuple[Any, ...]]:
    """A response's output items as what they say (not their ids, which differ from one response to the next)."""
    return [
        (o.type, o.status, o.content[0].text) if o.type == "message" else (o.type, o.status, o.name, o.arguments)
        for o in output
    ]


@pytest.mark.parametrize("forced", ["text then two calls", pytest.param("required", marks=pytest.mark.slow)])
def test_a_response_cut_off_in_its_calls_is_incomplete_with_the_calls_as_far_as_they_got(
    client: openai.OpenAI, forced: str
) -> None:
    """max_output_tokens reached while the model writes its calls: the response is incomplete (reason
    max_output_tokens), its message the text before the calls, its calls as far as they got (a call cut off inside
    its arguments is an incomplete item), as the chat route reads the same output; streamed alike, ending with
    ``response.incomplete``. Before, a response with any call was completed, and the markup of the call cut off was
    the message's text (``<tool_``), or the only call was lost in it."""
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    said = "Let me check.\n\n" + block % "Paris" + "\n" + block % "Rome"
    asked: dict[str, Any] = {"model": MODEL, "input": "Weather in Paris and Rome?", "tools": TOOLS, "temperature": 0}
    chat_asked: dict[str, Any] = {"tools": CHAT_TOOLS}
    if forced == "required":
        asked["tool_choice"] = chat_asked["tool_choice"] = "required"
    else:
        asked["extra_body"] = chat_asked["extra_body"] = {
            "structured_outputs": {"regex": re.escape(said).replace("\\ ", " ")}
        }
    whole = client.responses.create(**asked, max_output_tokens=200)
    assert whole.usage is not None
    cuts = set()
    for n in range(whole.usage.output_tokens // 3, whole.usage.output_tokens, 7):  # (in the text, in a call, between)
        response = client.responses.create(**asked, max_output_tokens=n)
        events = list(client.responses.create(**asked, max_output_tokens=n, stream=True))
        assert events[-1].type == "response.incomplete" and response.status == "incomplete"
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
        assert _said(events[-1].response.output) == _said(response.output)  # type: ignore[union-attr]
        chat = _chat(client, [{"role": "user", "content": asked["input"]}], max_tokens=n, **chat_asked)
        calls = [o for o in response.output if o.type == "function_call"]
        expected = [(c.function.name, c.function.arguments) for c in chat.message.tool_calls or ()]
        assert [(c.name, c.arguments) for c in calls] == expected
        if calls:
            assert response.output_text == (chat.message.content or "") and "<tool" not in response.output_text
            cuts.add((len(calls), calls[-1].status))
    # The sweep cut the output inside a call's arguments and after a whole call (the next one's tag begun, or its end
    # tag); with two calls, inside the second's too.
    assert {(1, "incomplete"), (1, "completed")} <= cuts
    assert forced == "required" or (2, "incomplete") in cuts


def test_an_assistant_message_and_its_calls_are_one_turn(client: openai.OpenAI) -> None:
    """A stateless client (``store: false``: Codex, the Agents SDK) sends back the assistant's message and its
    function calls as items: they are one assistant turn, the text and its calls, as a stored chain keeps it and as
    the chat route is given it. Before, the calls were a second assistant turn with empty content (another prompt)."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 20C"},
    ]
    response = client.responses.create(model=MODEL, input=items, tools=TOOLS, max_output_tokens=1, store=False)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20C"},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, max_tokens=1)
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_created_at_is_whole_seconds(client: openai.OpenAI) -> None:
    """``created_at`` is an integer of Unix seconds, as OpenAI sends it (it was a float), streamed or not."""
    asked: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 1}
    raw = client.responses.with_raw_response.create(**asked)
    assert isinstance(json.loads(raw.text)["created_at"], int)
    with client.responses.with_streaming_response.create(**asked, stream=True) as stream:
        bodies = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines() if line.startswith("data: ")]
    assert bodies and all(isinstance(b["response"]["created_at"], int) for b in bodies if "response" in b)


def test_conversation_and_background_are_refused_by_name(client: openai.OpenAI) -> None:
    """This server has no conversations object and no background mode: a request that names a conversation, or asks
    for background, is a 400 naming the field, where both were ignored (the response ran as another one)."""
    asked: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 1}
    for field, value in (("conversation", "conv_1"), ("conversation", {"id": "conv_1"}), ("background", True)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**asked, **{field: value})
        assert refused.value.body["param"] == field and field in refused.value.body["message"]  # type: ignore[index]
    assert client.responses.create(**asked, background=False).status in ("completed", "incomplete")


def test_a_call_of_a_dag_program_joins_the_threads_it_names(client: openai.OpenAI, hermes: Served) -> None:
    # parent_thread_ids, as on the chat route: the call starts where the threads it joins ended (ATLAS's critical
    # path). The Responses body took the field and dropped it, so a join counted only the call's own service.
    body = {"program_id": "dag-responses", "thread_id": "a"}
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, extra_body=body)
    joined = {"program_id": "dag-responses", "thread_id": "b", "parent_thread_ids": ["a"]}
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, extra_body=joined)
    record = hermes.engine.core.policy.table.get("dag-responses")  # type: ignore[attr-defined]
    assert record is not None and record.threads["b"].service_s > record.threads["a"].service_s


def test_a_response_under_way_is_retrieved_in_progress_and_a_delete_then_holds(client: openai.OpenAI) -> None:
    """While a stored response streams: ``GET`` gives it ``in_progress`` (and its input items), a response cannot
    continue it yet (400), and ``DELETE`` deletes it for good. Before, each was a 404 while it ran, and the deleted
    response was kept once it finished."""
    asked: dict[str, Any] = {"model": MODEL, "input": "Count to ten.", "max_output_tokens": 24, "temperature": 0}
    for delete in (True, False):
        with client.responses.create(**asked, stream=True) as events:
            created = next(iter(events))
            assert created.type == "response.created"
            rid = created.response.id
            running = client.responses.retrieve(rid)
            assert running.status == "in_progress" and running.output == []
            (item,) = client.responses.input_items.list(rid)
            assert item.content[0].text == "Count to ten."  # type: ignore[union-attr]
            with pytest.raises(openai.BadRequestError) as early:
                client.responses.create(model=MODEL, input="And then?", previous_response_id=rid)
            assert early.value.body["param"] == "previous_response_id"  # type: ignore[index]
            if delete:
                client.responses.delete(rid)
            kinds = [e.type for e in events]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        if delete:
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(rid)
        else:
            finished = client.responses.retrieve(rid)
            assert finished.status == kinds[-1].removeprefix("response.")
            assert client.responses.input_items.list(rid).data[0].id == item.id  # (the same ids after it ended)


def test_a_stored_stream_refused_before_it_began_is_not_left_in_progress(
    client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed response whose first delta never came (a 503, an engine failure, its client gone) was kept under
    way for ever: retrieved ``in_progress``, refused as ``previous_response_id``."""
    from boundless.api.errors import APIError
    from boundless.api.responses import ResponseStore
    from boundless.api.server import OpenAIServer

    started: list[str] = []
    start = ResponseStore.start

    def recorded(store: ResponseStore, rid: str, running: Any) -> None:
        started.append(rid)
        start(store, rid, running)

    async def refused(*args: object, **kwargs: object) -> object:
        raise APIError(503, "the engine is busy (the test's)")

    monkeypatch.setattr(ResponseStore, "start", recorded)
    monkeypatch.setattr(OpenAIServer, "started", refused)
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=True)
    (rid,) = started
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


def test_a_reasoning_items_text_is_the_next_assistant_turns_reasoning() -> None:
    """A stateless client sends back the reasoning before its calls (Codex's way): its text (reasoning_text parts as
    this server writes them, else the summary) becomes that turn's ``reasoning_content``, which a template keeping
    the reasoning before a call renders (gpt-oss's); an encrypted one, or one before a user's turn, adds nothing."""
    from boundless.api.responses import conversation

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]}
    messages = conversation(
        [
            {"role": "user", "content": "Hi"},
            thought,
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]
    )
    assert messages[1]["reasoning_content"] == "Look it up." and messages[1]["tool_calls"][0]["id"] == "c1"
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Short."}]}
    said = {"role": "assistant", "content": "Done."}
    assert conversation([{"role": "user", "content": "Hi"}, summary, said])[1]["reasoning_content"] == "Short."
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}
    assert "reasoning_content" not in conversation([{"role": "user", "content": "Hi"}, sealed, said])[1]
    assert "reasoning_content" not in conversation([thought, {"role": "user", "content": "Hi"}, said])[1]
    # This server's answer-first output (a preamble, then the reasoning, then the call) sent back as it came: the
    # reasoning is the call's turn's, as a chained response keeps it; two in a row are joined, a sealed one adds none.
    preamble = {"role": "assistant", "content": "Let me check."}
    turn = conversation([{"role": "user", "content": "Hi"}, preamble, thought, call])[1]
    assert turn["reasoning_content"] == "Look it up." and turn["content"] == "Let me check." and turn["tool_calls"]
    twice = conversation([{"role": "user", "content": "Hi"}, summary, sealed, thought, call])[1]
    assert twice["reasoning_content"] == "Short.\nLook it up."
