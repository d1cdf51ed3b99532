"""``scripts/gpu-check.sh`` is a device session's one run: a test it names that no longer exists (renamed, moved)
would fail its whole pytest stage there, minutes of a lent GPU. Here every pytest call of the script collects, on the
CPU, with the tests it names and its ``-k`` selection."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"
# pytest's options in the script that do not choose tests (the rest: -k and the paths).
RUN_OPTIONS = {"-p", "no:cacheprovider", "-q", "-rfE", "--tb=short"}


def pytest_calls() -> list[list[str]]:
    """Each pytest call's arguments that choose tests: ``-k`` and its expression, and the paths."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    calls = []
    for line in text.splitlines():
        if "-m pytest" not in line:
            continue
        words = shlex.split(line.split("-m pytest", 1)[1].split("2>&1", 1)[0])
        calls.append([w for w in words if w not in RUN_OPTIONS and not re.fullmatch(r"--maxfail=\d+", w)])
    return calls


def test_the_script_has_its_pytest_calls() -> None:
    assert len(pytest_calls()) == 6  # the default part, GPU_CHECK_PART=flex, =moe, =quantized and =more (two)


# One process collects for every call (pytest.main once a call, the test modules imported once): a process each
# took 4-6 s, most of it importing torch.
_COLLECT_ALL = """
import json, sys
import pytest

class Collected:
    def __init__(self): self.ids = []
    def pytest_collection_finish(self, session): self.ids = [item.nodeid for item in session.items]

results = []
for args in json.loads(sys.argv[1]):
    plugin = Collected()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[plugin])
    results.append({"code": int(code), "ids": plugin.ids})
print("COLLECTED " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def collected() -> list[dict]:
    """Each pytest call's exit code and the tests it collects, in the script's order."""
    env = {**os.environ, "BOUNDLESS_TEST_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECT_ALL, json.dumps(pytest_calls())],
        cwd=SCRIPT.parents[1], env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("COLLECTED ")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line.removeprefix("COLLECTED "))


@pytest.mark.parametrize("index", range(len(pytest_calls())), ids=lambda i: _call_id(pytest_calls()[i]))
def test_every_test_the_script_names_is_collected(collected: list[dict], index: int) -> None:
    args = pytest_calls()[index]
    paths = [a for a in args if a.startswith("tests/")]
    assert paths and all(Path(SCRIPT.parents[1], p.split("::")[0]).is_file() for p in paths)
    result = collected[index]
    assert result["code"] == 0, args
    # Every file the call names has a test it selects (a -k that matches nothing in a file drops it silently), and
    # so has every test it names (one a -k deselects would go unseen beside the file's others).
    ids = result["ids"]
    assert {p.split("::")[0] for p in paths} <= {nodeid.split("::")[0] for nodeid in ids}
    for path in (p for p in paths if "::" in p):
        assert any(nid == path or nid.startswith((path + "[", path + "::")) for nid in ids), path


def _call_id(args: list[str]) -> str:
    return next(p for p in args if p.startswith("tests/"))


def test_every_benchmark_call_of_the_script_parses() -> None:
    """A flag of ``bench gpu`` renamed or gone would stop the device run's stage at its first line."""
    import argparse

    from boundless.bench import gpu

    text = SCRIPT.read_text().replace("\\\n", " ")
    calls = [line.split("-m boundless.bench.gpu", 1)[1].split("2>&1", 1)[0] for line in text.splitlines()
             if "-m boundless.bench.gpu" in line]  # fmt: skip
    assert len(calls) >= 4
    for call in calls:
        parser = argparse.ArgumentParser(exit_on_error=False)
        gpu.add_arguments(parser)
        args = parser.parse_args(shlex.split(call))
        gpu._windows(args)  # (--windows is checked when a run starts)


def test_every_stage_of_the_default_part_but_the_last_gets_all_it_asks() -> None:
    """The default part's stages each run within what is left of its budget (``within N``): a stage whose ask, with
    the asks before it, passes the budget is cut short, and one past it never runs (the fp8 stage, added last after
    asks of 640 s in a budget of 580, got 1 s). Only the last stage may take what is left."""
    text = SCRIPT.read_text()
    default = text[text.index("deadline=") :]
    budget = int(re.search(r"GPU_CHECK_BUDGET:-(\d+)", default).group(1))
    asks = [int(n) for n in re.findall(r'within (\d+)\)"', default)]
    assert len(asks) >= 5
    assert sum(asks[:-1]) <= budget - 20, (asks, budget)
