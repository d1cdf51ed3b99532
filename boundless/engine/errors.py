"""Errors the engine raises for a bad request (as opposed to a failure of the engine)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request cannot be served as asked; ``param`` names the offending field, for API error objects."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
