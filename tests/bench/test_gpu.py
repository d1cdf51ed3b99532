"""``bench gpu`` end to end on small shapes (``--tiny``), on whatever device the tests run: the random
checkpoints it writes or draws, the comparison with transformers, the decode roofline, the JSON."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from boundless.attention import triton_paged
from boundless.bench import attention_tiles, gpu

# The GPU kernels on CUDA; else the PyTorch path. (Triton's interpreter runs them on the CPU too, but slowly: the
# kernels' own tests cover them there, and this test is about the benchmark's parts.)
TEST_DEVICE = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu")  # (conftest's: test modules do not import conftest, whose
# module name another directory's conftest may hold when files of several directories run together)
DEVICE = torch.device(TEST_DEVICE)
BACKEND = "triton" if DEVICE.type == "cuda" and triton_paged.available(DEVICE) else "torch"


# (The whole benchmark on small shapes, 15 s and 5 s on the CPU: the slow suite there; every flag of the device run's
# calls is parsed in the fast one, tests/test_gpu_check.py.)
def _slow_on_cpu(test: Callable[..., None]) -> Callable[..., None]:
    return pytest.mark.slow(test) if DEVICE.type == "cpu" else test


@_slow_on_cpu
def test_bench_gpu_runs_every_part_on_small_shapes(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["--tiny", "--device", TEST_DEVICE, "--workdir", str(tmp_path / "models"), "--json", str(out),
         "--max-model-len", "256", "--kv-cache-gb", "0.05", "--attention-backend", BACKEND, "--repeats", "1"]
    )  # fmt: skip
    results = gpu.run(args)
    assert json.loads(out.read_text()).keys() == results.keys()
    errors = {k: v for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not errors
    cases = [k for k in results if k.startswith("offline_1b_")]
    assert len(cases) == len(gpu.TINY_CASES)
    for key in cases:
        case = results[key]
        assert {f["system"] for f in case["figures"]} == {"huggingface", "boundless"}
        n, _, o = (int(x) for x in key.removeprefix("offline_1b_").split("x"))
        assert all(f["output_tokens"] == n * o for f in case["figures"])  # counted from the outputs
        assert case["hf_attention"] == "sdpa"
    split = results["host_split_1b"]  # the decode-heavy run's wall time, split among the engine's phases
    assert split["steps"] > 0 and 0 < split["execute_s"] < split["wall_s"] and split["schedule_s"] > 0
    assert split["schedule_s"] + split["execute_s"] + split["finish_step_s"] <= split["wall_s"]
    # The engine's own functions in it (the scheduler's only where it runs from source: compiled, cProfile sees none).
    assert "engine/core.py" in results["host_profile_1b"]["top_tottime"]
    # Multi-step decoding on the same case, against the same baseline; the largest window with asynchronous
    # scheduling too.
    for key in ("window8", "window16", "async_window16", "async_window1"):
        window = results[f"{key}_1b_4x16x8"]
        assert window["output_tokens_per_s"] > 0 and window["ratio_to_baseline"] > 0
        split = results[f"host_split_{key}_1b_4x16x8"] if key in ("window16", "async_window16") else None
        assert split is None or (split["steps"] >= 8 and split["schedule_s"] > 0)  # (a window's passes are steps)
    for n, i, o in gpu.TINY_CASES:  # asynchronous scheduling on every case, against each case's baseline
        assert results[f"async_window16_1b_{n}x{i}x{o}"]["ratio_to_baseline"] > 0
    # Windows alone decided ahead, beside it, on the first and the last case (the decode-heavy and long-prompt ones).
    first, last = ("x".join(map(str, c)) for c in (gpu.TINY_CASES[0], gpu.TINY_CASES[-1]))
    assert {k for k in results if k.endswith("_windows_only")} == {
        f"async_window16_1b_{first}_windows_only",
        f"async_window16_1b_{last}_windows_only",
    }
    assert all(results[f"async_window16_1b_{c}_windows_only"]["output_tokens_per_s"] > 0 for c in (first, last))
    decode = results["decode_8b"]
    # (A decode step is a difference of two timed runs: on these tiny shapes, noise may make it negative. The
    # figures are there; the roofline is computed, not timed.)
    assert isinstance(decode["decode_step_s"], float) and decode["roofline_step_s"] > 0
    # The same decode in windows of the largest --windows, decided ahead.
    assert isinstance(decode["async_window16_decode_step_s"], float)
    assert isinstance(decode["async_window16_step_over_roofline"], float)
    # The 8B stand-in's weights were drawn in memory: its directory holds no checkpoint.
    assert not list((tmp_path / "models" / "llama-8b").glob("*.safetensors"))


@pytest.mark.slow  # (10 s here: make test stays under 10 minutes; `make test-all` runs it)
def test_bench_gpu_runs_the_mixture_against_transformers_and_beside_itself(tmp_path: Path) -> None:
    """``--shapes moe``: a gpt-oss-shaped mixture with MXFP4 experts against transformers, then ours eagerly and with
    the experts dequantized, each against the same baseline; the experts held in MXFP4 where the kernels read them."""
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(
        ["--tiny", "--shapes", "moe", "--device", TEST_DEVICE, "--workdir", str(tmp_path), "--json",
         str(tmp_path / "moe.json"), "--max-model-len", "256", "--kv-cache-gb", "0.05", "--attention-backend",
         BACKEND, "--repeats", "1"]
    )  # fmt: skip
    results = gpu.run(args)
    assert not {k: v for k, v in results.items() if isinstance(v, dict) and "error" in v}
    n, i, o = gpu.TINY_MOE_CASES[0]
    case = results[f"offline_moe_{n}x{i}x{o}"]
    assert {f["system"] for f in case["figures"]} == {"huggingface", "boundless"}
    assert all(f["output_tokens"] == n * o for f in case["figures"])
    for key in ("eager_moe", "dequantized_moe"):
        assert results[f"{key}_{n}x{i}x{o}"]["ratio_to_baseline"] > 0
    assert results["moe_experts_in_mxfp4"] == (DEVICE.type == "cuda")


@_slow_on_cpu
def test_bench_gpu_decodes_the_8b_shape_as_quantized_checkpoints_held_as_stored(tmp_path: Path) -> None:
    """``--shapes 8b,fp8,int4``: the 8B stand-in's decode, then the same shape as an FP8 checkpoint (drawn in memory,
    its projections e4m3 with a scale a block) and as a 4-bit GPTQ one, each held as stored: against its own roofline,
    whose layers' bytes are about a half and a quarter of the bf16 one's, and against the bf16 decode."""
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(
        ["--tiny", "--shapes", "8b,fp8,int4", "--device", TEST_DEVICE, "--workdir", str(tmp_path), "--json",
         str(tmp_path / "fp8.json"), "--max-model-len", "256", "--kv-cache-gb", "0.05", "--attention-backend",
         BACKEND, "--repeats", "1", "--windows", ""]
    )  # fmt: skip
    results = gpu.run(args)
    assert not {k: v for k, v in results.items() if isinstance(v, dict) and "error" in v}
    bf16, fp8, int4 = results["decode_8b"], results["decode_8b_fp8"], results["decode_8b_int4"]
    assert fp8["held_as"] == "fp8 blocks of (16, 16)" and isinstance(fp8["speedup_over_bf16"], float)
    assert int4["held_as"] == "(bits, group) (4, 16)" and isinstance(int4["speedup_over_bf16"], float)
    # (The tiny shape's embedding and head stay 16-bit: its layers' bytes halve in e4m3, with a scale a block of 256,
    # and in 4 bits a quarter, with a scale and a zero point, 5 bytes, a group of 16: less still.)
    layers = {held: bf16["weight_bytes"] - fig["weight_bytes"] for held, fig in (("fp8", fp8), ("int4", int4))}
    assert 0.3 * bf16["weight_bytes"] < layers["fp8"] < 0.5 * bf16["weight_bytes"]
    assert layers["fp8"] < layers["int4"] < bf16["weight_bytes"]
    assert not list((tmp_path / "llama-8b-fp8").glob("*.safetensors"))


def test_bench_gpu_host_proxy_splits_each_windows_steps(tmp_path: Path) -> None:
    """``--shapes host``: the engine's host work on a one-layer model, any device (the CPU here), for a single step
    and each window: every pass of the run counted, the phases' times within its wall time."""
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(
        ["--shapes", "host", "--tiny", "--device", TEST_DEVICE, "--workdir", str(tmp_path), "--windows", "4",
         "--repeats", "1", "--json", str(tmp_path / "host.json"), "--attention-backend", BACKEND]
    )  # fmt: skip
    results = gpu.run(args)
    o = gpu.TINY_CASES[0][2]
    for window in ("window1", "window4", "async_window4"):
        split = results["host_proxy"][window]
        assert split["steps"] == o  # (a window's passes count as steps: the output's passes, plus none for prefill)
        assert 0 < split["schedule_s"] + split["execute_s"] + split["finish_step_s"] <= split["wall_s"]


@pytest.mark.parametrize("flags", [["--shapes", "1b,2b"], ["--windows", "8,sixteen"]])
def test_bench_gpu_refuses_unknown_shapes_and_windows(flags: list[str], tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(["--tiny", "--device", "cpu", "--workdir", str(tmp_path), *flags])
    with pytest.raises(SystemExit, match=flags[0]):
        gpu.run(args)
    assert not list(tmp_path.iterdir())  # nothing was built


def test_bench_gpu_without_cuda_says_so_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--device cuda`` (the default) where CUDA is not: each stage failed with a traceback, and the run exited 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(["--tiny", "--workdir", str(tmp_path), "--json", str(tmp_path / "bench.json")])
    with pytest.raises(SystemExit, match="--device cuda: CUDA is not available here; --device cpu runs"):
        gpu.run(args)
    assert not list(tmp_path.iterdir())  # nothing was built


def test_idle_gaps_says_where_the_gpu_waited() -> None:
    """The GPU's idle time between activities: the longest gaps first, each with when it began after the first
    activity; the idle time outside the first and last activity is the rest of the run's idle time."""
    gaps = [(500_000, 1_000_000), (30_000_000, 2_000_000), (2_000_000, 40_000_000)]  # (ns idle, ns after the first)
    out = gpu.idle_gaps(gaps, idle_s=0.05)
    assert out["idle_gaps_ms"] == [[30.0, 2.0], [2.0, 40.0], [0.5, 1.0]]
    assert out["idle_in_gaps_over_1ms_s"] == pytest.approx(0.032)
    assert out["idle_between_s"] == pytest.approx(0.0325)
    assert out["idle_outside_s"] == pytest.approx(0.0175)


def test_the_idle_time_between_activities_is_split_by_gap_size(capsys: pytest.CaptureFixture[str]) -> None:
    """A graph's kernels microseconds apart, eager launches, host work, a decision with the GPU idle: each class's
    gaps and milliseconds (a gap on a class's bound falls in it), printed under the run's busy line."""
    gaps = [(2_000, 0), (10_000, 5), (3_000, 9), (50_000, 20), (100_001, 30), (1_000_000, 40), (4_000_000, 50)]
    assert gpu.gap_sizes(gaps) == {
        "to_10us": {"gaps": 3, "ms": 0.015},
        "to_100us": {"gaps": 1, "ms": 0.05},
        "to_1ms": {"gaps": 2, "ms": 1.1},
        "over_1ms": {"gaps": 1, "ms": 4.0},
    }
    busy = {"busy_fraction": 0.8, "wall_s": 0.05, **gpu.idle_gaps(gaps, idle_s=0.01)}
    assert busy["idle_by_gap_size"] == gpu.gap_sizes(gaps)
    gpu._summary({"busy_async_window16_1b": busy})
    assert (
        "between, by gap size: to 10us 0.0 ms in 3, to 100us 0.1 ms in 1, to 1ms 1.1 ms in 2, over 1ms 4.0 ms in 1"
        in (capsys.readouterr().out)
    )


def test_a_timeline_sample_lists_the_kernels_of_the_runs_middle_with_the_idle_time_before_each() -> None:
    """Activities from the middle of the run on, each with its microseconds and the idle time since those before it
    ended (none for one that overlaps them)."""
    events = [(0, 10_000, "first"), (40_000, 50_000, "gemm"), (48_000, 52_000, "copy"), (55_000, 56_000, "norm"),
              (65_000, 70_000, "last")]  # fmt: skip
    assert gpu.timeline_sample(events, count=3) == [["gemm", 10.0, 30.0], ["copy", 4.0, 0.0], ["norm", 1.0, 3.0]]
    assert gpu.timeline_sample(events[:1]) == [["first", 10.0, 0.0]]
    assert gpu.timeline_sample([]) == []


def test_merge_spans_covers_overlaps_once_and_lists_the_gaps() -> None:
    """The GPU's busy time is the union of its activities (overlapping or touching ones count once); the gaps are
    where none ran, each with when it began after the first activity started."""
    spans = [(30, 40), (0, 10), (5, 12), (12, 15), (50, 60), (55, 58)]
    busy, gaps = gpu.merge_spans(spans)
    assert busy == 15 + 10 + 10
    assert gaps == [(15, 15), (10, 40)]


@pytest.mark.slow  # (13 s in the interpreter: make test stays under 10 minutes; `make test-all` runs it)
@pytest.mark.skipif(not triton_paged.available(DEVICE), reason="the Triton kernels do not run here")
def test_bench_gpu_sweeps_the_attention_tiles(tmp_path: Path) -> None:
    """``--shapes tiles``: every tile shape of a case's kind runs the case and gives the default shape's output; the
    fastest of them is picked; FlexAttention runs every case and agrees with the kernel, at the case's pages and at
    pages of 64; SDPA runs the same attention where its mask is the kernel's, and agrees with it."""
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    args = parser.parse_args(
        ["--tiny", "--shapes", "tiles", "--device", TEST_DEVICE, "--json", str(tmp_path / "t.json"), "--repeats", "1"]
    )
    results = gpu.run(args)
    tiles = {k.removeprefix("tiles_"): v for k, v in results.items() if k.startswith("tiles_")}
    assert set(tiles) == {case.name for case in attention_tiles.TINY_CASES}
    for name, case in tiles.items():
        assert len(case["configs"]) == 2 and all(row["ok"] for row in case["configs"]), name
        assert case["best"]["seconds"] == min(row["seconds"] for row in case["configs"])
        flex = case["flex"]
        assert len(flex) == (1 if name.startswith("decode") else len(attention_tiles.FLEX_PREFILL_TILES))
        assert all(row["ok"] for row in flex), flex
        assert case["flex_s"] == min(row["seconds"] for row in flex)
        large = case[f"page{attention_tiles.LARGE_PAGE}"]  # (the case again at pages of 64 tokens)
        assert large["default_s"] > 0 and large["flex"]["ok"] and large["flex_s"] == large["flex"]["seconds"]
        chunked = name.startswith("chunk")  # (SDPA's causal mask would differ: not run)
        assert ("sdpa_s" in case) != chunked
        assert chunked or case["sdpa_max_abs_diff"] < (1e-3 if DEVICE.type == "cpu" else 5e-2)  # (fp32; bf16)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_the_small_tile_grid_is_the_default_and_its_neighbours_in_the_full_grid(decode: bool) -> None:
    """``--tiles-grid small`` (a device session's run): the default first, then five other shapes, each one the full
    sweep would also time (so its figures compare with a full sweep's)."""
    small = attention_tiles.tile_grid(decode, small=True)
    full = attention_tiles.tile_grid(decode)
    assert small[0] == triton_paged.TileConfig() == full[0]
    assert len(set(small)) == len(small) == 6
    assert set(small) <= set(full)
