"""Cross-origin requests (CORS), so that a page in a browser may call the API: vLLM's flags ``--allowed-origins``,
``--allow-credentials``, ``--allowed-methods`` and ``--allowed-headers`` (:class:`~boundless.config.ServerConfig`),
with its defaults (any origin, method and header; no credentials). The lists are JSON on the command line, as vLLM
takes them (``'["http://localhost:3000"]'``). Starlette's ``CORSMiddleware`` answers a browser's preflight ``OPTIONS``
itself, before the API key is asked for (a browser sends none with it), and adds the headers to every other answer,
errors included.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from boundless.config import ServerConfig, json_strings


def with_cors(app: ASGIApp, config: ServerConfig) -> ASGIApp:
    """``app`` behind Starlette's ``CORSMiddleware`` with the server's CORS settings."""
    return CORSMiddleware(
        app,
        allow_origins=json_strings("allowed_origins", config.allowed_origins),
        allow_credentials=config.allow_credentials,
        allow_methods=json_strings("allowed_methods", config.allowed_methods),
        allow_headers=json_strings("allowed_headers", config.allowed_headers),
    )
