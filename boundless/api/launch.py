"""Starting the HTTP server: in the foreground (``boundless serve``) or in a thread (tests, embedding)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.main import STARTUP_FAILURE

from boundless.api.reasoning import reasoning_parser_name
from boundless.api.server import EngineClient, build_app, configured_chat_template
from boundless.api.server_log import StatsLog
from boundless.cluster.restarts import RestartPolicy, Restarts
from boundless.config import ClusterConfig, ConfigError, EngineConfig, ServerConfig, check_serve_configs
from boundless.engine.async_engine import ENGINE_ID, AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.tensor_parallel import load_with_ranks
from boundless.model.generation_config import NO_DEFAULTS, SamplingDefaults, model_sampling_defaults

log = logging.getLogger(__name__)


# Where a server started without --api-key finds its key, first found first: ours, then vLLM's (a vLLM deployment
# that keeps its key in the environment served here without one, open to anyone, and said nothing).
API_KEY_ENV = ("BOUNDLESS_API_KEY", "VLLM_API_KEY")


def resolve_api_key(config: ServerConfig) -> ServerConfig:
    """``--api-key`` wins; otherwise the first of :data:`API_KEY_ENV` set."""
    if config.api_key is None:
        for name in API_KEY_ENV:
            if os.environ.get(name):
                return replace(config, api_key=os.environ[name])
    return config


def local_engine(config: EngineConfig, max_waiting: int, cluster: ClusterConfig | None = None) -> AsyncEngine:
    """One engine in this process, as ``boundless serve`` runs it by default. A model split over devices is started
    again in place when it loses a rank (``--max-restarts``, ``--restart-delay-s``, ``--restart-reset-s``): rank 0's
    share stays loaded, the other ranks are launched afresh."""
    loaded, ranks = load_with_ranks(config)
    core = EngineCore.from_model(loaded, config, ranks=ranks)
    if config.model.tensor_parallel_size == 1:
        return AsyncEngine(core, max_waiting=max_waiting)
    restarts = Restarts(RestartPolicy.from_config(cluster or ClusterConfig()), [ENGINE_ID])
    return AsyncEngine(core, max_waiting, lambda: EngineCore.from_model(loaded, config), restarts)


def make_client(config: EngineConfig, cluster: ClusterConfig, max_waiting: int) -> EngineClient:
    """One engine in this process, or with ``--instances N`` (or prefill and decode engines) a cluster of Ray
    actors behind a router. Flags that act with a part this server lacks (prefill and decode engines, engines as Ray
    actors, KV lending, a disk store) are ignored, and said to be."""
    if ignored := cluster.ignored_role_flags():
        log.warning(
            "%s: with prefill and decode engines only (--prefill-instances, --decode-instances); ignored here",
            ", ".join(ignored),
        )
    if ignored := cluster.ignored_instance_flags(split=config.model.tensor_parallel_size > 1):
        log.warning(
            "%s: with engines as Ray actors only (--instances 2 or more, or roles); ignored here", ", ".join(ignored)
        )
    if ignored := cluster.ignored_lending_flags():
        log.warning(
            "%s: with --kv-lending on only (--kv-transport: or prefill and decode engines); ignored here",
            ", ".join(ignored),
        )
    if ignored := config.cache.ignored_store_flags():
        log.warning("%s: with a disk store only (--kv-disk-path); ignored here", ", ".join(ignored))
    if cluster.runs_actors:
        from boundless.cluster.client import ClusterClient

        return ClusterClient(config, cluster, max_waiting)
    return local_engine(config, max_waiting, cluster)


def warn_unread_reasoning(server: ServerConfig, tokenizer: Any) -> None:
    """``--structured-outputs-in-reasoning`` holds the reasoning a parser finds to the grammar: said to be ignored
    where no parser reads any (told once the model is loaded: a vocabulary of harmony's tags reads gpt-oss's reasoning
    without the flag)."""
    reads = reasoning_parser_name(server.reasoning_parser, server.tool_call_parser, tokenizer)
    if server.structured_outputs_in_reasoning and reads is None:
        log.warning("--structured-outputs-in-reasoning: with a reasoning parser only; ignored here")


def serve(config: EngineConfig, server: ServerConfig, cluster: ClusterConfig | None = None) -> None:
    """Load the model and serve until interrupted."""
    server = resolve_api_key(server)
    check_serve_configs(config, server, cluster or ClusterConfig())
    configured_chat_template(server)  # a bad --chat-template fails before the model loads
    check_bindable(server.host, server.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = make_client(config, cluster or ClusterConfig(), server.max_waiting)
    warn_unread_reasoning(server, engine.tokenizer)
    # What start-up built (the model's objects, the imported modules, the engine) lives as long as the server: out
    # of the collector's full walks, as vLLM's engine freezes its start-up heap. A 256-request decode run spent ~10% of
    # its wall time in the collector's walks of it (docs/engine.md).
    gc.collect()
    gc.freeze()
    name = server.served_model_name[0] if server.served_model_name else config.model.model
    scheme = "https" if server.ssl_certfile else "http"
    log.info(
        "serving %s on %s://%s:%d%s (context %d tokens)",
        name, scheme, server.host, server.port, server.root_path, engine.max_model_len,
    )  # fmt: skip
    defaults = model_sampling_defaults(config.model.model, server.generation_config, server.generation_overrides)
    if defaults.given():
        log.info(
            "omitted sampling parameters default to %s (--generation-config %s, --override-generation-config)",
            defaults.given(),
            server.generation_config,
        )
    app = build_app(engine, name, server, {m.name: m.path for m in config.model.loras}, defaults)
    http = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.uvicorn_log_level,
        root_path=server.root_path,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    stats_log = None if server.disable_log_stats else StatsLog(engine.stats, time.monotonic)
    # uvicorn raises the signal again once it has shut down, under the handler it found: SIGTERM's default one would
    # end the process there, before the engine's shutdown below (the disk store's last writes, the executor's).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if stats_log is not None:
            stats_log.start()
        http_server = Server(http, engine.end_requests)
        with contextlib.suppress(KeyboardInterrupt):  # (as uvicorn.run: the signal, raised again once it is handled)
            http_server.run()
    finally:
        if stats_log is not None:
            stats_log.stop()
        engine.shutdown()
        log.info("stopped: the engine's writes are handed over")
    if not http_server.started:  # (as uvicorn.run)
        sys.exit(STARTUP_FAILURE)


def check_bindable(host: str, port: int) -> None:
    """That ``host`` names an address of this machine and ``port`` is free there, before the model loads (uvicorn
    found out once it bound, minutes later, in a line that named neither flag). A port taken between this check and
    the bind still fails there."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host: {host!r} names no address here ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds: a port in TIME_WAIT is free)
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot bind there ({e.strerror})") from None


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM's handler once uvicorn is done with it: exit as the signal would (128 + its number), cleanly."""
    raise SystemExit(128 + signum)


class Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT or SIGTERM first ends the requests in flight (``end_requests``: each with a
    503 error object, a stream with an error event and ``[DONE]``) and refuses new ones, so that its graceful shutdown
    waits for no generation: uvicorn would wait out its timeout, then cancel them, each cut off without an error."""

    def __init__(self, config: uvicorn.Config, end_requests: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.end_requests = end_requests
        self.interrupted = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # (A signal handler: it runs in the middle of whatever the main thread runs; shutdown() ends the requests.)
        self.interrupted = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.interrupted and self.end_requests is not None:
            try:
                self.end_requests()
            except Exception:
                log.exception("ending the requests in flight failed")
        await super().shutdown(sockets)


# Seconds the server keeps an idle connection open. Longer than clients keep idle connections in their pools
# (httpx, under the openai client: 5 s), so a client never reuses a connection the server is just closing: at
# uvicorn's default of 5 s both ends expire it at the same moment, and now and then a client's call goes out on a
# connection the server closes under it ("Connection error"; one call in a few hundred with agent programs,
# whose tool waits leave connections idle for seconds).
KEEP_ALIVE_S = 65  # (uvicorn.Config takes whole seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """An HTTP server on 127.0.0.1 in a background thread, for tests and embedding."""

    def __init__(self, app: ASGIApp, port: int | None = None, end_requests: Callable[[], None] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off", timeout_keep_alive=KEEP_ALIVE_S
        )
        # (stop() ends no request: tests start one server after another on an engine; handle_exit() does.)
        self.server = Server(config, end_requests)
        self.thread = threading.Thread(target=self.server.run, name="boundless-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_in_thread(
    client: EngineClient,
    model_name: str,
    config: ServerConfig | None = None,
    loras: dict[str, str] | None = None,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> ServerThread:
    app = build_app(client, model_name, config, loras, defaults)
    return ServerThread(app, end_requests=getattr(client, "end_requests", None)).start()
