"""Cross-origin requests (CORS), so that a page in a browser may call the API: vLLM's flags ``--allowed-origins``,
``--allowed-credentials``, ``--allowed-methods`` and ``--allowed-headers``, with its defaults (any origin, method and
header; no credentials). The lists are JSON on the command line, as vLLM takes them (``'["http://localhost:3000"]'``).
Starlette's ``CORSMiddleware`` answers a browser's preflight ``OPTIONS`` itself, before the API key is asked for (a
browser sends none with it), and adds the headers to every other answer, errors included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from starlette.types import ASGIApp

from boundless.config import ConfigError

_ANY = '["*"]'


def _json_strings(flag: str, text: str) -> list[str]:
    """A flag's JSON list of strings; anything else raises :class:`ConfigError` naming the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--{flag}: not JSON ({e}); give a list such as '[\"*\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"--{flag}: must be a JSON list of strings, such as '[\"*\"]'")
    return value


@dataclass(frozen=True)
class CorsConfig:
    """The ``serve`` flags that say which cross-origin requests a browser may make (the lists checked when it is
    made: a bad one stops ``serve`` before the model loads)."""

    allowed_origins: str = field(
        default=_ANY,
        metadata={"help": "origins a browser may call the API from, a JSON list (vLLM's): '[\"https://a.example\"]'"},
    )
    allowed_credentials: bool = field(
        default=False, metadata={"help": "let cross-origin requests carry cookies and authorization (vLLM's flag)"}
    )
    allowed_methods: str = field(
        default=_ANY, metadata={"help": "HTTP methods cross-origin requests may use, a JSON list (vLLM's flag)"}
    )
    allowed_headers: str = field(
        default=_ANY, metadata={"help": "headers cross-origin requests may send, a JSON list (vLLM's flag)"}
    )

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            _json_strings(name.replace("_", "-"), getattr(self, name))

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind Starlette's ``CORSMiddleware`` with these settings."""
        from starlette.middleware.cors import CORSMiddleware

        return CORSMiddleware(
            app,
            allow_origins=_json_strings("allowed-origins", self.allowed_origins),
            allow_credentials=self.allowed_credentials,
            allow_methods=_json_strings("allowed-methods", self.allowed_methods),
            allow_headers=_json_strings("allowed-headers", self.allowed_headers),
        )
