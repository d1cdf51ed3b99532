"""Starting the server's engine (``api/launch.py``): what start-up says of the flags it was given."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from boundless.api.launch import make_client, resolve_api_key
from boundless.config import ClusterConfig, ServerConfig
from boundless.llm import engine_config


def test_flags_of_prefill_and_decode_engines_are_ignored_without_them_and_start_up_says_so(
    model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """``--kv-path`` as ``--pd-alpha`` and the other "with roles" flags: accepted without prefill and decode engines,
    and ignored, which start-up says in one line (it said nothing of ``--kv-path``). Defaults are not named."""
    cluster = ClusterConfig(kv_path="basic", pd_alpha=512, kv_handoff_timeout_s=60.0)
    assert ClusterConfig(kv_path="basic", prefill_instances=1).ignored_role_flags() == []
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=256, kv_cache_gb=0.01)
    with caplog.at_level(logging.WARNING, logger="boundless.api.launch"):
        engine = make_client(config, cluster, max_waiting=8)
    engine.shutdown()
    said = [r.getMessage() for r in caplog.records if r.name == "boundless.api.launch"]
    assert said == [
        "--kv-path, --pd-alpha: with prefill and decode engines only (--prefill-instances, --decode-instances); "
        "ignored here"
    ]


def test_flags_of_kv_lending_are_ignored_without_it_and_start_up_says_so(
    model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """``--lending-*`` act with ``--kv-lending on`` only, ``--kv-transport`` with it or with prefill and decode engines:
    without them they were accepted and ignored, and start-up said nothing (as it said of the "with roles" flags)."""
    cluster = ClusterConfig(lending_interval_s=4.0, lending_min_gain=0.01, kv_transport="nixl")
    assert ClusterConfig(instances=2, kv_lending="on", lending_interval_s=4.0).ignored_lending_flags() == []
    assert ClusterConfig(kv_transport="nixl", prefill_instances=1).ignored_lending_flags() == []
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=256, kv_cache_gb=0.01)
    with caplog.at_level(logging.WARNING, logger="boundless.api.launch"):
        engine = make_client(config, cluster, max_waiting=8)
    engine.shutdown()
    said = [r.getMessage() for r in caplog.records if r.name == "boundless.api.launch"]
    assert said == [
        "--lending-interval-s, --kv-transport: with --kv-lending on only (--kv-transport: or prefill and decode "
        "engines); ignored here"
    ]


def test_flags_of_ray_instances_are_ignored_by_one_engine_and_start_up_says_so(
    model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """``--routing``, the heartbeats', stuck steps' and restarts' flags act where engines run as Ray actors: with one
    engine in the server's process they were accepted and ignored in silence."""
    cluster = ClusterConfig(routing="round-robin", step_timeout_s=30.0, max_restarts=3)
    assert ClusterConfig(instances=2, routing="round-robin").ignored_instance_flags() == []
    assert ClusterConfig(prefill_instances=1, step_timeout_s=30.0).ignored_instance_flags() == []
    # A model split over devices restarts in place when it loses a rank: the restarts' flags act on it.
    assert cluster.ignored_instance_flags(split=True) == ["--routing", "--step-timeout-s"]
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=256, kv_cache_gb=0.01)
    with caplog.at_level(logging.WARNING, logger="boundless.api.launch"):
        engine = make_client(config, cluster, max_waiting=8)
    engine.shutdown()
    said = [r.getMessage() for r in caplog.records if r.name == "boundless.api.launch"]
    assert said == [
        "--routing, --step-timeout-s: with engines as Ray actors only (--instances 2 or more, or roles); ignored here"
    ]


@pytest.mark.parametrize(
    ("flag", "env", "key"),
    [
        (None, {"VLLM_API_KEY": "v"}, "v"),
        (None, {"BOUNDLESS_API_KEY": "b", "VLLM_API_KEY": "v"}, "b"),
        ("f", {"BOUNDLESS_API_KEY": "b", "VLLM_API_KEY": "v"}, "f"),
        (None, {}, None),
    ],
)
def test_the_api_key_comes_from_the_flag_then_our_variable_then_vllms(
    monkeypatch: pytest.MonkeyPatch, flag: str | None, env: dict[str, str], key: str | None
) -> None:
    """vLLM reads its key from ``VLLM_API_KEY`` when ``--api-key`` is not given: a vLLM deployment moved here with its
    environment served without a key, open to anyone."""
    for name in ("BOUNDLESS_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resolve_api_key(ServerConfig(api_key=flag)).api_key == key


def test_flags_of_the_disk_store_are_ignored_without_one_and_start_up_says_so(
    model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """``--kv-write-policy``, ``--kv-disk-gb`` and ``--kv-load-timeout-s`` act on the store at ``--kv-disk-path``:
    without one they were accepted and ignored in silence."""
    config = engine_config(
        str(model_dirs["tiny-llama"]), max_model_len=256, kv_cache_gb=0.01, kv_write_policy="back", kv_disk_gb=4.0
    )
    assert dataclasses.replace(config.cache, kv_disk_path=str(tmp_path)).ignored_store_flags() == []
    with caplog.at_level(logging.WARNING, logger="boundless.api.launch"):
        engine = make_client(config, ClusterConfig(), max_waiting=8)
    engine.shutdown()
    said = [r.getMessage() for r in caplog.records if r.name == "boundless.api.launch"]
    assert said == ["--kv-disk-gb, --kv-write-policy: with a disk store only (--kv-disk-path); ignored here"]
