"""Agents' own session ids read as their programs: Claude Code's (its header, its ``metadata.user_id``) and Codex's."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from served_models import serve_hermes

from boundless.api.agent_sessions import claude_code_session, header_session


@pytest.mark.parametrize(
    ("user_id", "session"),
    [
        (json.dumps({"device_id": "d1", "account_uuid": "", "session_id": "54c1eb09"}), "54c1eb09"),  # v2.1.78 on
        ("user_5f3a_account_9b_session_57a121ec-f78c", "57a121ec-f78c"),  # before
        ("user-42", None),  # another client's user, not a session
        (json.dumps({"session_id": "s" * 300}), None),  # too long for a program id: ignored, not refused
        ("{not json", None),
        (json.dumps(["session_id"]), None),
    ],
)
def test_claude_codes_session_in_its_user_id(user_id: str, session: str | None) -> None:
    assert claude_code_session(user_id) == session


def test_session_headers_most_specific_first() -> None:
    assert header_session({"session_id": "codex", "X-Claude-Code-Session-Id": "claude"}) == "claude"
    assert header_session({"session-id": "codex"}) == "codex"
    assert header_session({"session_id": ""}) is None and header_session({}) is None


def test_claude_codes_metadata_names_the_program_on_the_messages_api(tmp_path: Path) -> None:
    with serve_hermes(tmp_path) as served:
        client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
        user_id = json.dumps({"device_id": "d1", "account_uuid": "", "session_id": "cc-session-1"})
        for _ in range(2):
            client.messages.create(
                model="tiny",
                max_tokens=2,
                messages=[{"role": "user", "content": "Hi"}],
                metadata={"user_id": user_id},
            )
        record = served.engine.core.policy.table.get("cc-session-1")  # type: ignore[attr-defined]
        assert record is not None and record.completed_calls == 2


def test_a_prompt_cache_key_that_cannot_name_a_program_is_ignored_not_refused() -> None:
    """OpenAI takes any string as prompt_cache_key; one that is no program id (empty, too long) names no program, and
    the request is served as it was before the key named programs."""
    from boundless.api.responses import ResponsesRequest
    from boundless.api.schemas import ChatCompletionRequest

    for key in ("", "k" * 300):
        chat = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": key}
        )
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "prompt_cache_key": key})
        from types import SimpleNamespace

        from boundless.api.server import _program

        assert _program(chat, SimpleNamespace(headers={})) is None  # type: ignore[arg-type]
