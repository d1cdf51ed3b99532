"""Errors the engine raises for a bad request (as opposed to a failure of the engine)."""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI's error code for a request whose prompt, or prompt and the tokens asked for, exceed the context: agents read
# it (not the message) to compact their history and retry.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass(frozen=True)
class ContextOverflow:
    """What did not fit the context: a prompt of ``prompt_tokens`` and ``max_tokens`` more asked for (None: none
    given), against ``max_model_len`` (each API words its error from these: Anthropic's differs from OpenAI's)."""

    prompt_tokens: int
    max_tokens: int | None
    max_model_len: int


class InvalidRequestError(ValueError):
    """A request cannot be served as asked; ``param`` names the offending field and ``code`` is OpenAI's code for the
    error (``invalid_value``, or :data:`CONTEXT_LENGTH_EXCEEDED` with the ``overflow``), for API error objects."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str = "invalid_value",
        overflow: ContextOverflow | None = None,
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.overflow = overflow

    def renamed(self, param: str) -> InvalidRequestError:
        """The same error naming ``param``: the field as the client's route calls it."""
        return InvalidRequestError(str(self), param, self.code, self.overflow)


class EngineLost(RuntimeError):
    """A part the engine cannot run without is gone (a rank of a tensor-parallel model): the step that found it
    fails, and the engine stops there (no later step could run)."""


# The end of a call whose instance was lost while no other could take it (every queue full, or none live and none
# coming back): the server's state, not the request's fault, so a 503 to retry, not an engine error.
NO_ROOM_AFTER_FAILOVER = "the request's instance was lost and no other could take it; retry the request"
