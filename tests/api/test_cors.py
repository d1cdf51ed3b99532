"""CORS (vLLM's ``--allowed-origins``, ``--allow-credentials``, ``--allowed-methods``, ``--allowed-headers``): a
browser's preflight ``OPTIONS`` is answered (it was a 405), and answers carry the headers that let a page read them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from served_models import Served, serve_hermes

from boundless.cli import _subcommand, build_parser, main
from boundless.config import ServerConfig, from_flags
from boundless.config_file import expand_config_file

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
PAGE = "http://app.example"


def _preflight(served: Served, origin: str, method: str = "POST") -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(served.url + "/v1/chat/completions", headers=headers, timeout=60)


@pytest.fixture(scope="module")
def open_to_all(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(tmp_path_factory.mktemp("cors")) as served:
        yield served


@pytest.fixture(scope="module")
def one_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = ServerConfig(
        api_key="secret", allowed_origins=f'["{PAGE}"]', allow_credentials=True, allowed_methods='["POST"]'
    )
    with serve_hermes(tmp_path_factory.mktemp("cors"), server_config=config) as s:
        yield s


def test_by_default_any_page_may_call_the_api(open_to_all: Served) -> None:
    """vLLM's defaults: any origin, method and header, no credentials."""
    preflight = _preflight(open_to_all, "http://anywhere.example")
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in preflight.headers
    answer = httpx.post(
        open_to_all.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "http://anywhere.example"}, timeout=60
    )
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"


def test_the_flags_limit_origins_and_methods_and_come_before_the_api_key(one_page: Served) -> None:
    """A preflight carries no API key: it is answered before the key is asked for; the 401 of a call without the key
    still carries the headers, so the page can read why. Another origin, or a method not allowed, is refused."""
    preflight = _preflight(one_page, PAGE)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert _preflight(one_page, "http://elsewhere.example").status_code == 400
    assert _preflight(one_page, PAGE, method="DELETE").status_code == 400
    unkeyed = httpx.post(one_page.url + "/v1/chat/completions", json=CHAT, headers={"Origin": PAGE}, timeout=60)
    assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == PAGE
    other = httpx.post(
        one_page.url + "/v1/chat/completions",
        json=CHAT,
        headers={"Origin": "http://elsewhere.example", "Authorization": "Bearer secret"},
        timeout=60,
    )
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_the_flags_take_json_lists_on_the_command_line_and_in_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As vLLM takes them: JSON lists on the command line; a YAML list in ``--config``. A list that is not JSON stops
    ``serve`` with one line and exit 2, before the model loads."""
    parser = build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", f'["{PAGE}"]', "--allowed-credentials"])
    cors = from_flags(ServerConfig, args)
    assert (cors.allowed_origins, cors.allow_credentials, cors.allowed_methods) == (f'["{PAGE}"]', True, '["*"]')
    config = tmp_path / "serve.yaml"
    config.write_text(f"allowed-origins: [{PAGE}, http://b.example]\nallowed_headers: [content-type]\n")
    args = parser.parse_args(["serve", *expand_config_file(_subcommand(parser, "serve"), ["--config", str(config)])])
    cors = from_flags(ServerConfig, args)
    assert (cors.allowed_origins, cors.allowed_headers) == (f'["{PAGE}", "http://b.example"]', '["content-type"]')
    assert main(["serve", "--allowed-origins", PAGE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("boundless: --allowed-origins: not JSON") and len(err.strip().splitlines()) == 1
    assert main(["serve", "--allowed-methods", '"POST"']) == 2
    assert "--allowed-methods: must be a JSON list of strings" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "yaml", "allowed"),
    [
        (["--allow-credentials"], "", True),
        (["--allow-credentials", "--no-allow-credentials"], "", False),
        ([], "allow-credentials: true\n", True),
        (["--allowed-credentials"], "", True),  # (the name it had here before)
        ([], "allowed_credentials: true\n", True),
    ],
)
def test_credentials_take_vllms_flag_allow_credentials(
    tmp_path: Path, given: list[str], yaml: str, allowed: bool
) -> None:
    """vLLM's flag is ``--allow-credentials``; a vLLM command line or config file with it stopped at start-up
    (argparse's "unrecognized arguments"), as the flag was only ``--allowed-credentials`` here."""
    parser = build_parser()
    argv = list(given)
    if yaml:
        config = tmp_path / "serve.yaml"
        config.write_text(yaml)
        argv = expand_config_file(_subcommand(parser, "serve"), ["--config", str(config), *given])
    assert from_flags(ServerConfig, parser.parse_args(["serve", *argv])).allow_credentials is allowed
