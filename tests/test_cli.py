"""The command line: ``boundless serve`` as ``make serve`` runs it, ``bench serve`` against it, ``generate``.

``serve`` runs as ``make serve`` does, in its own process; the other commands run their ``main`` in this one (the
same parsing and dispatch, without importing torch anew for each)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from boundless.api.launch import free_port
from boundless.cli import main
from boundless.config import EngineConfig, ServerConfig

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _boundless(*args: str) -> list[str]:
    return [sys.executable, "-m", "boundless.cli", *args]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def _serve(*args: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _boundless("serve", "--port", str(port), *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_serve_stops_its_engine_on_sigterm_and_sigint(model_dirs: dict[str, Path], sig: signal.Signals) -> None:
    """What systemd, Docker and Kubernetes send (SIGTERM) shuts the engine down as Ctrl-C does: uvicorn raised SIGTERM
    again under its default handler once it had stopped, which ended the process before the engine's shutdown (the
    disk store's last writes)."""
    port = free_port()
    args = ["serve", "--port", str(port), "--model", str(model_dirs["tiny-llama"]), "--kv-cache-gb", "0.05"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_boundless(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "stopped: the engine's writes are handed over" in out
    assert proc.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else 0)


@pytest.fixture(scope="module")
def tiny_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tiny model served with some of its flags from a YAML file (vLLM's ``--config``): the served name the tests
    below ask for comes from it."""
    config = tmp_path_factory.mktemp("config") / "serve.yaml"
    config.write_text(f"model: {model_dirs['tiny-llama']}\nserved_model_name: tiny\nkv-cache-gb: 0.05\n")
    yield from _serve("--config", str(config))


def test_a_config_file_gives_flags_that_the_command_line_overrides(tmp_path: Path) -> None:
    """``serve --config``: each key a flag (``-`` or ``_``), a switch set either way, a list for a flag of several
    values, a mapping as a JSON flag's text; a flag on the command line wins, before or after ``--config``."""
    from boundless.cli import _subcommand, build_parser
    from boundless.config_file import expand_config_file

    config = tmp_path / "serve.yaml"
    config.write_text(
        "max-num-seqs: 3\nenable_prefix_caching: false\nasync-scheduling: true\nport: 9001\n"
        "lora-modules: [a=/x, b=/y]\nspeculative-config: {method: ngram, num_speculative_tokens: 3}\n"
        "api-key:\n"
    )
    parser = build_parser()
    for given in (["--config", str(config), "--port", "9002"], ["--port", "9002", f"--config={config}"]):
        args = parser.parse_args(["serve", *expand_config_file(_subcommand(parser, "serve"), given)])
        assert (args.max_num_seqs, args.enable_prefix_caching, args.async_scheduling) == (3, False, True)
        assert args.port == 9002 and args.lora_modules == ["a=/x", "b=/y"] and args.api_key is None
        assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("max-num-seq: 3\n", "'max-num-seq' is not a flag of this command"),
        ("- port\n", "must be a mapping of flag names to values"),
        ("port: [1\n", "not YAML"),
        ("enable-prefix-caching: maybe\n", "'enable-prefix-caching' is a switch: true or false"),
        (None, "cannot read it"),
    ],
)
def test_a_config_file_that_says_no_flag_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, said: str
) -> None:
    config = tmp_path / "serve.yaml"
    if text is not None:
        config.write_text(text)
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("boundless: --config ") and said in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("given", [["--conf", "{path}"], ["--con={path}"], ["--config", "{path}"]])
def test_a_config_file_given_by_an_abbreviation_of_config_is_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], given: list[str]
) -> None:
    """argparse takes ``--conf`` for ``--config``; the file was looked for under the full name alone, so its flags were
    left out and serve started without them."""
    import boundless.api.launch as launch

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine started without the file's flags")

    monkeypatch.setattr(launch, "make_client", refuse)
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 0\n")
    assert main(["serve", *(g.format(path=config) for g in given)]) == 2
    assert capsys.readouterr().err == "boundless: --max-num-seqs: must be positive\n"
    with pytest.raises(SystemExit) as stopped:  # (--chat-template too: argparse's usage error)
        main(["serve", "--c", str(config)])
    assert stopped.value.code == 2 and "ambiguous option: --c" in capsys.readouterr().err


def test_serve_with_no_flags_serves_the_bundled_model() -> None:
    for url in _serve():
        models = httpx.get(url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
        assert models["data"][0]["max_model_len"] == 8192
        r = httpx.post(
            url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200


def test_bench_serve_poisson_and_trace_replay(tiny_server: str, tmp_path: Path) -> None:
    out = tmp_path / "poisson.json"
    common = ["--base-url", tiny_server, "--model", "tiny", "--vocab-size", "300"]
    argv = ["bench", "serve", *common, "--num-requests", "8", "--rate", "20", "--input-len", "16", "--output-len", "4"]
    assert main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["completed"] == 8 and figures["failed"] == 0
    assert 0 < figures["ttft_s_p50"] <= figures["ttft_s_p99"] and figures["output_token_throughput"] > 0
    trace = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    if not trace.exists():  # a checkout without ../shared: the same format, written here
        trace = tmp_path / "azure.csv"
        rows = [f"2023-11-16 18:15:{10 + i:02d}.0000000,{300 + 40 * i},{20 + i}" for i in range(8)]
        trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "trace.json"
    argv = ["bench", "serve", *common, "--base-url", tiny_server + "/v1"]  # the API root works as well
    argv += ["--trace", str(trace), "--num-requests", "6", "--time-scale", "0.05", "--length-scale", "0.05"]
    assert main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["completed"] == 6 and figures["mean_input_len"] < 200


def test_generate_prints_the_completion(model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(model_dirs["tiny-llama"])
    assert main(["generate", "The fox", "--model", tiny, "--max-tokens", "4", "--kv-cache-gb", "0.05"]) == 0
    assert capsys.readouterr().out.strip()


def test_bad_flag_values_fail_at_start_up(model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "x", "--model", str(model_dirs["tiny-llama"]), "--block-size", "12"]) == 2
    assert "--block-size" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(model_dirs["tiny-llama"]), "--hf-overrides", "[1]"]) == 2
    assert "--hf-overrides: must be a JSON object" in capsys.readouterr().err


def test_serve_on_a_gpu_it_cannot_use_ends_in_one_line(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``boundless serve --device cuda:N`` past this machine's GPUs (every --device cuda on a CPU machine) ends with
    one line naming the device, not PyTorch's traceback."""
    past = f"cuda:{torch.cuda.device_count() + 3}"
    argv = ["serve", "--model", str(model_dirs["tiny-llama"]), "--device", past, "--port", str(free_port())]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"boundless: device {past}: ") and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--max-tokens", "-1"], "--max-tokens: max_tokens must be a positive integer"),
        (["--temperature", "-1"], "--temperature: temperature must be in [0, 2]"),
        (["--top-k", "-7"], "--top-k: "),
        (["--sample-seed", str(2**64)], "--sample-seed: "),  # (not --seed, the engine's own flag)
        (["--max-model-len", "2"], "boundless: this model's maximum context length is 2"),  # (the prompt's length)
        (["--model", "/nonexistent"], "model '/nonexistent' is neither"),
    ],
)
def test_generate_with_a_bad_value_says_so_and_exits_2(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """A sampling flag's value, a prompt too long for the context, a model that is not there: one line naming the flag,
    exit status 2 (each was a traceback and status 1)."""
    tiny = ["--model", str(model_dirs["tiny-llama"]), "--kv-cache-gb", "0.05", "--max-model-len", "512"]
    assert main(["generate", "The fox", *tiny, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("boundless: ") and said in err and "Traceback" not in err
    assert main(["generate", "", *tiny]) == 2 and "the prompt is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", [("--tool-call-parser", "x"), ("--reasoning-parser", "granite"), ("--generation-config", "hf")]
)
def test_bad_server_flag_values_fail_at_start_up(flag: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before anything loads, with the flag named and its values listed."""
    assert main(["serve", *flag]) == 2
    assert f"boundless: {flag[0]}: must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--uvicorn-log-level", "loud"], "--uvicorn-log-level: must be one of critical, error, warning, info, debug"),
        (["--root-path", "llm"], "--root-path: must be a path that starts with / and does not end with one"),
        (["--ssl-keyfile", "key.pem"], "--ssl-certfile: HTTPS needs the certificate (--ssl-certfile) beside the key"),
        (["--ssl-keyfile", "nokey", "--ssl-certfile", "nocert"], "--ssl-keyfile: 'nokey' is not a file"),
        (["--enable-log-requests", "--disable-log-requests"], "--disable-log-requests: contradicts"),
        (["--max-log-len", "-1"], "--max-log-len: must not be negative"),
        (["--no-enable-chunked-prefill"], "--enable-chunked-prefill: prompts are always chunked"),
        (["--tokenizer", "other/tokenizer"], "--tokenizer: the model's own is used"),
        (["--download-dir", "/tmp"], "--download-dir: nothing is downloaded"),
    ],
)
def test_vllms_serve_flags_that_cannot_hold_fail_at_start_up(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's flags of the log, uvicorn and the engine: a value that cannot hold is one line naming the flag, before
    anything loads."""
    assert main(["serve", *args]) == 2
    assert f"boundless: {said}" in capsys.readouterr().err


def test_serve_takes_vllms_command_line_over_https_and_logs_each_request(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A vLLM command line runs as it is (``--trust-remote-code``, ``--enable-chunked-prefill``, the log's and
    uvicorn's flags): served over HTTPS with the key and certificate given, each request logged with its prompt cut to
    ``--max-log-len``, and uvicorn's own lines at the level asked (no access line at ``warning``)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    args = [
        "serve", str(model_dirs["tiny-llama"]), "--port", str(port), "--kv-cache-gb", "0.05", "--trust-remote-code",
        "--enable-chunked-prefill", "--enable-log-requests", "--max-log-len", "4", "--uvicorn-log-level", "warning",
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_boundless(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"https://127.0.0.1:{port}"
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", verify=trusted, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "server did not become healthy"
                time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):  # (not the certificate of a trusted authority)
            httpx.get(url + "/health", timeout=5)
        body = {"model": str(model_dirs["tiny-llama"]), "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 3}
        reply = httpx.post(url + "/v1/completions", json=body, verify=trusted, timeout=60)
        assert reply.status_code == 200, reply.text
        rid = reply.json()["id"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"Received request {rid}: prompt: " in out
    assert "prompt_token_ids: [5, 6, 7, 8], params: SamplingParams(n=1, " in out
    assert f"serving {model_dirs['tiny-llama']} on https://127.0.0.1:{port} " in out
    assert "POST /v1/completions" not in out  # (uvicorn's access lines are INFO)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--rates", "abc"], "--rates: 'abc' is not comma-separated numbers"),
        (["--rates", "1,,2"], "--rates: "),
        (["--rates", "-1"], "--rates: no value may be negative"),
        (["--num-programs", "0"], "--num-programs: must be positive"),
        (["--scale", "-1"], "--scale: must be positive"),
        (["--step-base-s", "-1"], "--step-base-s: must not be negative"),
        (["--policies", "fcfs,"], "--policies: "),
        (["--profile", "nonexistent"], "--profile: no profile 'nonexistent'"),
    ],
)
def test_simulate_with_a_bad_value_says_so_before_it_runs(
    capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """Each ran a meaningless sweep (a negative rate, scale or step time) or failed with a traceback; now it stops
    with the flag's message, as simulate's other checks do, before any row runs."""
    with pytest.raises(SystemExit, match=said):
        main(["simulate", "--num-programs", "2", "--policies", "fcfs", "--no-progress", *args])
    assert "rate/s" not in capsys.readouterr().out


# A longctx run that gets past the cluster's own checks (lending needs 2 instances and a profile) and is quick:
# an unchecked trace flag would run its meaningless rows, or fail with a traceback.
LONGCTX = ["simulate", "--workload", "longctx", "--instances", "2", "--profile", "cpu", "--num-programs", "4"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--short-prompt", "abc"], "--short-prompt: 'abc' is not comma-separated whole numbers"),
        (["--short-prompt=-5,10"], "--short-prompt: every value must be positive"),
        (["--short-prompt", "10"], "--short-prompt: min,max"),
        (["--short-prompt", "200,10"], "--short-prompt: min,max"),
        (["--short-output", "0,4"], "--short-output: every value must be positive"),
        (["--long-factors", "x"], "--long-factors: 'x' is not comma-separated numbers"),
        (["--long-factors=-1"], "--long-factors: every value must be positive"),
        (["--long-factors", "0.75,nan"], "--long-factors: every value must be a finite number"),
        (["--rates=-1"], "--rates: no value may be negative"),
        (["--rates", "abc"], "--rates: 'abc' is not comma-separated numbers"),
        (["--kv-modes", ","], "--kv-modes: no mode"),
    ],
)
def test_simulate_longctx_with_a_bad_trace_flag_says_so_before_it_runs(
    capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """Each ran rows of meaningless requests (a negative factor's long request cut to one token, a negative rate)
    or failed with a traceback; now the flag's one line, as simulate's other flags, before any row runs."""
    with pytest.raises(SystemExit, match=said):
        main([*LONGCTX, "--rates", "1", "--no-progress", *args])
    assert "rate/s" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([*LONGCTX, "--long-output", "0"], "argument --long-output: must be at least 1, not 0"),
        (["simulate", "calibrate", "--repeats", "0"], "argument --repeats: must be at least 1, not 0"),
        (["simulate", "calibrate", "--output-tokens", "0"], "argument --output-tokens: must be at least 1, not 0"),
        (["simulate", "validate", "--repeats", "0"], "argument --repeats: must be at least 1, not 0"),
        (["bench", "serve", "--num-requests", "0"], "argument --num-requests: must be at least 1, not 0"),
        (["bench", "offline", "--num-prompts", "0"], "argument --num-prompts: must be at least 1, not 0"),
        (["bench", "programs", "--num-programs", "0"], "argument --num-programs: must be at least 1, not 0"),
        (["bench", "programs", "--rate=-1"], "argument --rate: must be a finite number, not negative: '-1'"),
        (["bench", "gpu", "--cases", "0"], "argument --cases: must be at least 1, not 0"),
        (["bench", "gpu", "--repeats", "0"], "argument --repeats: must be at least 1, not 0"),
        (["bench", "serve", "--rate=-2"], "argument --rate: must be a finite number, not negative: '-2'"),
        (["bench", "serve", "--input-len", "0"], "argument --input-len: must be at least 1, not 0"),
        (["bench", "serve", "--time-scale", "nan"], "argument --time-scale: must be a finite number"),
        (["bench", "offline", "--output-len", "0"], "argument --output-len: must be at least 1, not 0"),
        (["bench", "longctx", "--rate=-1"], "argument --rate: must be a finite number, not negative: '-1'"),
        (["simulate", "validate", "--num-programs", "0"], "argument --num-programs: must be at least 1, not 0"),
        (["simulate", "calibrate", "--rate=-1"], "argument --rate: must be a finite number, not negative: '-1'"),
    ],
)
def test_a_count_below_1_or_a_negative_rate_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """argparse refuses it (status 2, the flag named) before the command runs: each ran its work first (up to a
    minute of measuring, a model's load) and then failed with a traceback, or ran a meaningless benchmark."""
    _no_work(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_bench_programs_checks_its_sweep_rates_before_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--sweep``, ``--rates`` as simulate's: a negative rate ran its programs at meaningless arrival times."""
    _no_work(monkeypatch)
    with pytest.raises(SystemExit, match=r"--rates: no value may be negative: '0\.1,-1'"):
        main(["bench", "programs", "--sweep", "--rates", "0.1,-1"])


def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that got past its flags fails the test at once, rather than load a model or measure for a minute."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command ran: its flags were not refused")

    from boundless.bench import gpu, offline, programs
    from boundless.model import loader
    from boundless.sim import calibrate

    # (Where each command takes the function from: validate and bench programs import it when they run.)
    for module in (loader, calibrate, offline):
        monkeypatch.setattr(module, "load_configured_model", refuse)
    monkeypatch.setattr(programs, "make_programs", refuse)
    monkeypatch.setattr(gpu, "_stage", refuse)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--batch-sizes", "0"], "--batch-sizes: every value must be positive: '0'"),
        (["--prompt-lens", "16,x"], "--prompt-lens: '16,x' is not comma-separated whole numbers"),
        (["--held-out-batch-sizes=-3"], "--held-out-batch-sizes: every value must be positive"),
    ],
)
def test_calibrate_checks_its_grid_before_it_measures(
    monkeypatch: pytest.MonkeyPatch, args: list[str], said: str
) -> None:
    """A batch size of 0 failed only when the fit found no steps, after ~50 s of measuring."""
    _no_work(monkeypatch)
    with pytest.raises(SystemExit, match=said):
        main(["simulate", "calibrate", *args])


def test_calibrate_refits_a_shipped_profile_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--refit cpu`` takes the shipped profile's name, as ``--profile`` does (it was a FileNotFoundError's
    traceback); one without measured steps, or none at all, is the flag's one line."""
    out = tmp_path / "refit.json"
    assert main(["simulate", "calibrate", "--refit", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["calibration"]["refit_of"] == "cpu"
    with pytest.raises(SystemExit, match="--refit: the profile 'h100' keeps no measured steps"):
        main(["simulate", "calibrate", "--refit", "h100"])
    with pytest.raises(SystemExit, match="--refit: no profile 'bogus': a path, or one of"):
        main(["simulate", "calibrate", "--refit", "bogus"])
    with pytest.raises(SystemExit, match="--check: no file"):
        main(["simulate", "calibrate", "--refit", "cpu", "--check", str(tmp_path / "missing.json")])


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--profile", "bogus"], "--profile: no profile 'bogus'"),
        (["--instances", "2", "--cluster-profile", "bogus"], "--cluster-profile: no profile 'bogus'"),
    ],
)
def test_validate_with_a_missing_profile_says_which_flag(
    monkeypatch: pytest.MonkeyPatch, args: list[str], said: str
) -> None:
    """Before the model loads (it was a ValueError's traceback)."""
    _no_work(monkeypatch)
    with pytest.raises(SystemExit, match=said):
        main(["simulate", "validate", "--instances", "1", "--workloads", "chat", *args])


def test_bench_serve_with_a_missing_trace_says_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--trace: No such file or directory: '.*missing\.jsonl'"):
        main(["bench", "serve", "--trace", str(tmp_path / "missing.jsonl"), "--base-url", "http://127.0.0.1:9"])


def test_bench_serve_without_a_server_says_it_cannot_reach_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A port nothing listens on: every request failed, and it printed a table of NaN and exited 0."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match=re.escape(f"--base-url: cannot reach the server at {url}/v1")):
        main(["bench", "serve", "--base-url", url, "--num-requests", "2", "--rate", "100"])
    assert "nan" not in capsys.readouterr().out


def test_bench_serve_with_a_model_the_server_lacks_says_so(
    tiny_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match=r"--model: the server at \S+ does not serve 'nope'"):
        main(["bench", "serve", "--base-url", tiny_server, "--model", "nope", "--num-requests", "2", "--rate", "100"])
    assert "nan" not in capsys.readouterr().out


def test_bench_serve_whose_every_request_fails_says_why(tiny_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The server answers the test request but refuses every request of the load (prompts past its context): the
    server's error and a failing status, not a table of NaN and status 0."""
    argv = ["bench", "serve", "--base-url", tiny_server, "--model", "tiny", "--vocab-size", "300", "--rate", "100"]
    with pytest.raises(SystemExit, match=r"bench serve: all 2 requests failed: BadRequestError.*maximum context"):
        main([*argv, "--num-requests", "2", "--input-len", "5000", "--output-len", "2"])
    assert "nan" not in capsys.readouterr().out


def test_a_cluster_with_a_missing_model_says_so_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each actor's load failed, a RayActorError's traceback; now the model's one line, as with one instance."""
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Ray started before the model was found")

    monkeypatch.setattr(ray, "init", refuse)
    assert main(["serve", "--instances", "2", "--model", "/nonexistent"]) == 2
    assert "boundless: model '/nonexistent' is neither" in capsys.readouterr().err


def test_bench_longctx_checks_its_long_factors_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A factor that is not a positive number was a traceback (``abc``) or a meaningless long request (``-1``)."""
    _no_work(monkeypatch)
    for bad, said in (("abc", "is not comma-separated numbers"), ("1,-1", "every value must be positive")):
        with pytest.raises(SystemExit, match=f"--long-factors: .*{said}"):
            main(["bench", "longctx", "--long-factors", bad])


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "needs --enable-lora"),
        (["--enable-lora", "--instances", "2"], "needs a single engine instance"),
        (["--enable-lora", "--prefill-instances", "1"], "needs a single engine instance"),
    ],
)
def test_runtime_lora_updating_without_what_it_needs_stops_serve_at_start_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """``--allow-runtime-lora-updating`` without ``--enable-lora``, or with a cluster, was accepted: the server came up
    and refused each ``/v1/load_lora_adapter`` later with a 400. Now one line, before any engine starts."""
    import boundless.api.launch as launch

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine started")

    monkeypatch.setattr(launch, "make_client", refuse)
    assert main(["serve", "--allow-runtime-lora-updating", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"boundless: --allow-runtime-lora-updating: {said}") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bench", "programs", "--scale=-1"], "argument --scale: must be a finite number above 0: '-1'"),
        (["bench", "programs", "--call-scale", "0"], "argument --call-scale: must be a finite number above 0"),
        (["bench", "programs", "--tool-wait=-1"], "argument --tool-wait: must be a finite number, not negative"),
        (["bench", "programs", "--max-len", "0"], "argument --max-len: must be at least 1, not 0"),
        (["bench", "restart", "--scale", "inf"], "argument --scale: must be a finite number above 0: 'inf'"),
        (["bench", "restart", "--max-len=-5"], "argument --max-len: must be at least 1, not -5"),
        (["bench", "agentic", "--turn-scale", "0"], "argument --turn-scale: must be a finite number above 0"),
        (["bench", "agentic", "--num-sessions", "0"], "argument --num-sessions: must be at least 1, not 0"),
        (["bench", "agentic", "--storage-gbps", "0"], "argument --storage-gbps: must be a finite number above 0"),
        (["bench", "agentic", "--host-sessions", "0"], "argument --host-sessions: must be at least 1, not 0"),
        (["simulate", "calibrate", "--scale=-0.1"], "argument --scale: must be a finite number above 0"),
        (["simulate", "validate", "--tool-wait=-2"], "argument --tool-wait: must be a finite number, not negative"),
    ],
)
def test_a_bench_workloads_shape_flags_are_checked_as_simulates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """``simulate`` refused a negative ``--scale`` or ``--tool-wait``; the benchmarks that take the same workload flags
    ran them (``bench programs --scale -1`` loaded the model and served a meaningless workload, exit 0)."""
    _no_work(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_bench_agentic_checks_its_sweep_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rate of ``--sweep-gbps`` that is no number failed with a ValueError's traceback after every other run."""
    _no_work(monkeypatch)
    for bad, said in (("abc", "is not comma-separated numbers"), ("0.4,0", "every value must be positive")):
        with pytest.raises(SystemExit, match=f"--sweep-gbps: .*{said}"):
            main(["bench", "agentic", "--sweep-gbps", bad])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bench", "longctx", "--max-num-seqs", "4"], "--max-num-seqs: bench longctx sets it itself (use --max-seqs)"),
        (["bench", "longctx", "--kv-cache-gb", "1"], "--kv-cache-gb: bench longctx sets it itself (use --num-kv"),
        (["bench", "longctx", "--policy", "plas"], "--policy: bench longctx sets it itself (fcfs on every instance)"),
        (["bench", "longctx", "--no-enable-prefix-caching"], "--enable-prefix-caching: bench longctx sets it itself"),
        (["bench", "lora", "--max-loras", "2"], "--max-loras: bench lora sets it itself (use --num-adapters)"),
        (["bench", "lora", "--lora-modules", "a=/x"], "--lora-modules: bench lora sets it itself"),
        (["bench", "agentic", "--kv-disk-path", "/tmp/x"], "--kv-disk-path: bench agentic sets it itself"),
        (["bench", "agentic", "--kv-write-policy", "back"], "--kv-write-policy: bench agentic sets it itself"),
        (["bench", "agentic", "--kv-cache-gb", "1"], "--kv-cache-gb: bench agentic sets it itself"),
    ],
)
def test_an_engine_flag_a_benchmark_sets_itself_is_refused_not_ignored(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], said: str
) -> None:
    """``bench longctx``, ``bench lora`` and ``bench agentic`` take every engine flag but set some on their engines:
    those were accepted and silently ignored (``bench longctx --max-num-seqs 4`` ran 16 a step); now one line, as
    ``bench spec`` says of ``--speculative-config``."""
    _no_work(monkeypatch)
    from boundless.bench import lora

    monkeypatch.setattr(lora, "load_configured_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit, match=re.escape(said)):
        main(argv)


class _Started(Exception):
    """What a patched ``make_client`` raises with the engine config serve would have started."""


@pytest.mark.parametrize(
    ("given", "yaml"),
    [
        (["{model}"], ""),
        (["{model}", "--port", "9001"], ""),
        (["--port", "9001", "{model}"], ""),
        (["{model}", "--model", "smollm2-135m"], ""),  # (vLLM's: the model given first wins)
        (["{model}", "--config", "{config}"], "lora-modules: [a=/x]\nmodel: smollm2-135m\n"),
    ],
)
def test_serve_takes_the_model_first_as_vllm_serve_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, given: list[str], yaml: str
) -> None:
    """``vllm serve MODEL`` is how vLLM's users start a server; ``boundless serve MODEL`` stopped with argparse's
    "unrecognized arguments", so a vLLM command line had to be rewritten to ``--model MODEL``. After a ``--config``
    file's list flag (``lora-modules``) the model is not taken as one of its values."""
    import boundless.api.launch as launch

    def started(config: EngineConfig, *args: object) -> None:
        raise _Started(config)

    monkeypatch.setattr(launch, "make_client", started)
    model, config = tmp_path / "model", tmp_path / "serve.yaml"
    config.write_text(yaml)
    with pytest.raises(_Started) as start:
        main(["serve", *(g.format(model=model, config=config) for g in given), "--enable-lora"])
    assert start.value.args[0].model.model == str(model)


def test_serve_takes_several_served_model_names_as_vllm_does(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--served-model-name a b``: both are the model's names (the second was taken for the model to serve)."""
    import boundless.api.launch as launch

    def started(config: EngineConfig, *args: object) -> None:
        raise _Started(config)

    monkeypatch.setattr(launch, "make_client", started)
    seen: list[tuple[str, ...]] = []
    check = launch.check_serve_configs
    monkeypatch.setattr(
        launch, "check_serve_configs", lambda c, s, cl: (seen.append(s.served_model_name), check(c, s, cl))
    )
    with pytest.raises(_Started) as start:
        main(["serve", str(tmp_path / "model"), "--served-model-name", "a", "b"])
    assert start.value.args[0].model.model == str(tmp_path / "model") and seen == [("a", "b")]


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        (["--override-generation-config", '{"temp": 1}'], "keys ['temp'] are not sampling parameters read here"),
        (["--override-generation-config", '{"top_k": 1.5}'], "top_k must be a number"),
        (["--override-generation-config", "[1]"], "must be a JSON object"),
        (["--generation-config", "/nonexistent"], "must be auto, vllm or a directory"),
    ],
)
def test_bad_generation_config_flags_fail_at_start_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: list[str], said: str
) -> None:
    """vLLM's ``--override-generation-config`` and ``--generation-config DIR`` are taken; a value they cannot take is
    the flag's one line before anything loads."""
    import boundless.api.launch as launch

    monkeypatch.setattr(launch, "make_client", lambda *a, **k: pytest.fail("the engine started"))
    assert main(["serve", *flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"boundless: {flag[0]}: ") and said in err and len(err.splitlines()) == 1


def test_generation_config_flags_from_a_config_file(tmp_path: Path) -> None:
    """``override-generation-config`` as a YAML mapping, as vLLM's config file gives it."""
    from boundless.cli import _subcommand, build_parser
    from boundless.config import ServerConfig, from_flags
    from boundless.config_file import expand_config_file

    config = tmp_path / "serve.yaml"
    config.write_text(f"generation-config: {tmp_path}\noverride-generation-config: {{temperature: 0.5, top_k: 4}}\n")
    parser = build_parser()
    args = parser.parse_args(["serve", *expand_config_file(_subcommand(parser, "serve"), ["--config", str(config)])])
    server = from_flags(ServerConfig, args)
    assert server.generation_config == str(tmp_path)
    assert server.generation_overrides == {"temperature": 0.5, "top_k": 4}


def test_a_config_file_gives_on_and_off_to_flags_of_words(tmp_path: Path) -> None:
    """YAML 1.1 reads ``on`` and ``off`` as booleans: ``kv-lending: on`` came as ``true``, refused as "must be on or
    off", and ``layerwise-load: on`` the same, though the file said what the flag takes."""
    from boundless.cli import _subcommand, build_parser
    from boundless.config_file import expand_config_file

    config = tmp_path / "serve.yaml"
    config.write_text("kv-write-policy: off\nlayerwise-load: on\nkv-lending: yes\nenable-prefix-caching: on\n")
    parser = build_parser()
    args = parser.parse_args(["serve", *expand_config_file(_subcommand(parser, "serve"), ["--config", str(config)])])
    assert (args.kv_write_policy, args.layerwise_load, args.kv_lending) == ("off", "on", "on")
    assert args.enable_prefix_caching is True  # (a switch takes the boolean as such)


def test_structured_outputs_in_reasoning_without_a_reasoning_parser_is_said_to_be_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The flag holds the reasoning a parser finds to the grammar; without a parser there is none, and it was
    accepted and ignored in silence. Told once the model is loaded: a vocabulary of harmony's tags (gpt-oss's) reads
    its reasoning without the flag."""
    from boundless.api.launch import warn_unread_reasoning
    from boundless.api.reasoning import HARMONY_TAGS

    class Vocabulary:
        def __init__(self, tokens: tuple[str, ...]) -> None:
            self.tokens = tokens

        def token_to_id(self, token: str) -> int | None:
            return self.tokens.index(token) if token in self.tokens else None

    plain, harmony = Vocabulary(("a", "b")), Vocabulary(HARMONY_TAGS)
    warned = "--structured-outputs-in-reasoning: with a reasoning parser only; ignored here"
    for flags, vocabulary, said in (
        ({}, plain, True),
        ({"reasoning_parser": "qwen3"}, plain, False),
        ({}, harmony, False),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="boundless.api.launch"):
            warn_unread_reasoning(ServerConfig(structured_outputs_in_reasoning=True, **flags), vocabulary)
        assert (warned in [r.getMessage() for r in caplog.records]) is said


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "validate", "--tensor-parallel-size", "2"],
        ["bench", "kv-dtype", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2"],
        ["bench", "longctx", "-tp", "2"],
    ],
)
def test_commands_whose_engines_run_on_one_device_refuse_a_split_model(argv: list[str]) -> None:
    """They took ``--tensor-parallel-size`` and ignored it (calibration and validation run one device's engines), or
    failed part-way (a second engine on one loaded network)."""
    with pytest.raises(SystemExit, match="does not take a split model; boundless serve, generate, simulate"):
        main(argv)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--kv-cache-gb", "1e308"], "--kv-cache-gb: 1e+308 GiB is more than any machine holds"),
        (["--kv-host-gb", "1e308"], "--kv-host-gb: "),
        (["--max-body-mb", "1e308"], "--max-body-mb: "),
        (["--seed", "99999999999999999999999"], "--seed: must be a signed 64-bit integer"),
        (["--device", "cudax"], "--device: unknown device 'cudax'"),
        (["--api-key", ""], "--api-key: "),
        (["--api-key", "a\nb"], "--api-key: "),
        (["--served-model-name", ""], "--served-model-name: a name must not be empty"),
        (["--instances", "3", "--prefill-instances", "1", "--decode-instances", "1"], "--instances: "),
        (["--kv-transport", "nixl", "--prefill-instances", "1", "--decode-instances", "1"], "needs the 'nixl' package"),
        (["--host", "not_an_address"], "--host: 'not_an_address' names no address here"),
        (["--instances", "2", "--ray-address", "127.0.0.1:1"], "--ray-address: nothing answers at 127.0.0.1:1"),
        (["--hf-overrides", '{"num_attention_heads": "x"}'], "--hf-overrides: "),
        (["--hf-overrides", '{"num_hidden_layers": 0}'], "--hf-overrides: num_hidden_layers must be a positive"),
        (["--hf-overrides", '{"max_position_embeddings": 0}'], "--hf-overrides: max_position_embeddings must be"),
    ],
)
def test_serve_flags_a_fuzzer_found_ending_in_tracebacks_are_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str],
    args: list[str], said: str,
) -> None:  # fmt: skip
    """Each was a traceback (some after the model had loaded), or served (an empty API key: no authentication)."""
    import boundless.api.launch as launch

    def unserved(*_: object, **__: object) -> None:
        raise AssertionError("served")

    monkeypatch.setattr(launch.uvicorn.Server, "run", unserved)
    model = ["--model", str(model_dirs["tiny-llama"]), "--kv-cache-gb", "0.02"]
    if any(a.startswith("--kv-cache-gb") for a in args):
        model = model[:2]
    assert main(["serve", *model, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("boundless: ") and said in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_serve_on_a_port_in_use_says_so_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    import boundless.api.launch as launch

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the model loaded")

    monkeypatch.setattr(launch, "make_client", refuse)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"--host 127.0.0.1 --port {port}: cannot bind there" in capsys.readouterr().err


def test_broken_model_files_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{bad")
    gguf = tmp_path / "empty.gguf"
    gguf.write_bytes(b"")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    for model, said in (
        (broken, "its config.json does not read as JSON"),
        (gguf, "not a GGUF file"),
        (cut, "not a GGUF file"),
    ):
        assert main(["generate", "hi", "--model", str(model)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    # A store directory that cannot be made (nothing to read there either) is the flag's error, not a store of nothing.
    assert main(["generate", "hi", "--kv-disk-path", "/proc/boundless-kv", "--max-tokens", "1"]) == 2
    assert "--kv-disk-path: /proc/boundless-kv does not exist, nor can it be made" in capsys.readouterr().err


def test_a_config_files_value_that_starts_with_a_dash_is_the_flags(tmp_path: Path) -> None:
    """``api-key: "-secret"`` became ``--api-key -secret``, which argparse read as a flag: "expected one argument"."""
    from boundless.cli import _subcommand, build_parser
    from boundless.config_file import ConfigFileError, expand_config_file

    config = tmp_path / "serve.yaml"
    config.write_text('api-key: "-secret"\n')
    parser = build_parser()
    args = parser.parse_args(["serve", *expand_config_file(_subcommand(parser, "serve"), ["--config", str(config)])])
    assert args.api_key == "-secret"
    config.write_text("no-enable-lora: false\n")
    with pytest.raises(ConfigFileError, match="write the switch's own name, enable-lora: false"):
        expand_config_file(_subcommand(parser, "serve"), ["--config", str(config)])


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["simulate", "--call-scale", "inf"], "--call-scale: must be positive and finite"),
        (["simulate", "--tool-wait", "inf"], "--tool-wait: must not be negative or infinite"),
        (["simulate", "--json", "/proc/boundless/x.json"], "argument --json: cannot write"),
        (["bench", "store", "--path", "{tmp}", "--gb", "0"], "argument --gb: must be a finite number above 0"),
        (["bench", "store", "--path", "{tmp}", "--gb", "1e9"], "--gb 1e+09: "),
        (["bench", "store", "--path", "{tmp}", "--block-size", "0"], "argument --block-size: must be at least 1"),
        (["bench", "transport", "--sizes", "0"], "--sizes: every size must be at least a byte"),
        (["bench", "transport", "--window", "0"], "argument --window: must be at least 1"),
        (["bench", "handoff", "--prompt-tokens", "0"], "--prompt-tokens: every value must be positive"),
        (["bench", "longctx", "--instances", "1"], "--instances: at least 2"),
        (["bench", "agentic", "--phases", "foo"], "--phases: offline, online or both"),
        (["bench", "lora", "--rank", "-1"], "argument --rank: must be at least 1"),
        (["bench", "structured", "--num-conversations", "0"], "argument --num-conversations: must be at least 1"),
        (["bench", "serve", "--vocab-size", "50"], "--vocab-size: more than 100"),
        (["simulate", "validate", "--instances", "abc"], "--instances: 'abc' is not comma-separated whole numbers"),
        (["simulate", "calibrate", "--threads", "-1"], "argument --threads: must be at least 0"),
        (["simulate", "calibrate", "--kv-path", "foo"], "argument --kv-path: invalid choice"),
        (["simulate", "calibrate", "--check", "{tmp}/none.json"], "--check: with --refit only"),
    ],
)
def test_simulate_and_bench_values_a_fuzzer_found_stop_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """Each was a traceback (after the run, for an output file), a hang (``--block-size 0``), or wrote until the disk
    was full (``bench store --gb 100000``); now it stops with the flag's message before the work begins."""
    with pytest.raises(SystemExit) as stopped:
        main([a.format(tmp=tmp_path) for a in args])
    message = str(stopped.value.code) if stopped.value.code not in (2, None) else capsys.readouterr().err
    assert said in message, message
    assert not any(tmp_path.iterdir())  # (nothing written)
