"""Errors the engine raises for a bad request (as opposed to a failure of the engine)."""

from __future__ import annotations

# OpenAI's error code for a request whose prompt, or prompt and the tokens asked for, exceed the context: agents read
# it (not the message) to compact their history and retry.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InvalidRequestError(ValueError):
    """A request cannot be served as asked; ``param`` names the offending field and ``code`` is OpenAI's code for the
    error (``invalid_value``, or :data:`CONTEXT_LENGTH_EXCEEDED`), for API error objects."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# The end of a call whose instance was lost while no other could take it (every queue full, or none live and none
# coming back): the server's state, not the request's fault, so a 503 to retry, not an engine error.
NO_ROOM_AFTER_FAILOVER = "the request's instance was lost and no other could take it; retry the request"
