"""The hot modules compiled with mypyc: loaded when their build is there, the same results as their source."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from boundless import compiled
from boundless.programs.policies import QueueConfig
from boundless.sim.parallel import CallAdd, Window

needs_build = pytest.mark.skipif(
    compiled.installed() is None,
    reason="no compiled build of these sources (make builds it: boundless.compiled.main)",
)


def _python(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@needs_build
def test_the_modules_load_from_their_build_unless_turned_off() -> None:
    code = "import boundless.kv.block_pool as m; from boundless.compiled import is_compiled; print(is_compiled(m))"
    assert _python(code, BOUNDLESS_COMPILED="1") == "True"
    assert _python(code, BOUNDLESS_COMPILED="0") == "False"


def test_a_build_is_named_by_its_sources(tmp_path: Path) -> None:
    # Another set of sources (here: fewer modules) is another build; the finder finds only what the build holds.
    assert compiled.build_key() != compiled.build_key(compiled.MODULES[:-1])
    finder = compiled.CompiledFinder(tmp_path)
    assert finder.find_spec("boundless.kv.block_pool") is None  # (an empty build: the source's finder goes on)
    assert finder.find_spec("json") is None


def test_a_build_is_put_in_place_at_once_where_the_temporary_directory_is_another_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build is gathered beside its place and renamed there: a rename across file systems (a tmpfs ``/tmp``, the
    cache on disk) fails (EXDEV), and the modules then ran from source. mypyc's run is stood in for: each module's
    extension written where mypyc writes it."""
    modules = compiled.MODULES[:2]
    monkeypatch.setenv("BOUNDLESS_CACHE_DIR", str(tmp_path / "cache"))

    def mypyc(cmd: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess:
        for name in modules:
            compiled._extension(Path(cwd), name).write_bytes(b"built " + name.encode())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    rename = os.rename

    def one_file_system(src: str | Path, dst: str | Path) -> None:
        if Path(src).parent != Path(dst).parent:  # (as if each directory were its own file system)
            raise OSError(18, "Invalid cross-device link")  # (EXDEV)
        rename(src, dst)

    monkeypatch.setattr(compiled.subprocess, "run", mypyc)
    monkeypatch.setattr(compiled.os, "rename", one_file_system)
    dest = compiled.build(modules)
    assert dest == compiled.build_dir(modules) and (dest / "complete").is_file()
    assert all(compiled._extension(dest, name).read_bytes() == b"built " + name.encode() for name in modules)
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # (nothing of the gathering left beside it)
    assert dest.stat().st_mode & 0o777 == dest.parent.stat().st_mode & 0o777  # (as readable as any directory made)


@pytest.mark.skipif(
    importlib.util.find_spec("mypyc") is None or shutil.which("cc") is None,
    reason="no mypyc or no C compiler here: the modules run from source",
)
def test_the_sources_build_where_mypyc_and_a_c_compiler_are() -> None:
    """A source that mypyc refuses (a type it cannot compile) fails here, with mypyc's message. ``make`` only reports
    a failed build and runs the source, and the tests above then skip: the fault would go unseen. (The build ``make
    test`` made before the tests is found at once.)"""
    assert compiled.build().is_dir()  # (raises with mypyc's output when it fails)


def test_a_failed_build_is_reported_and_leaves_the_source_to_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing(modules: object = None) -> Path:
        raise RuntimeError("mypyc failed (1):\nno C compiler")

    monkeypatch.setattr(compiled, "build", failing)
    assert compiled.main([]) == 0  # (make goes on: the source runs)
    assert "build failed, the modules run from source" in capsys.readouterr().err
    assert compiled.main(["--strict"]) == 1


@needs_build
def test_frozen_dataclasses_of_compiled_modules_pickle() -> None:
    # Compiled, mypyc's own pickling set a frozen dataclass's fields one by one and failed; the workers' windows and
    # the engines' configs cross processes.
    add = CallAdd(1.5, "3", "r", b"\x01\x00", None, "p", None, ("t",), None, None, None)
    for value in (Window(0.02, [add]), QueueConfig()):
        assert pickle.loads(pickle.dumps(value)) == value


@needs_build
def test_a_windowed_simulation_gives_the_same_rows_compiled_and_from_source(tmp_path: Path) -> None:
    rows = {}
    for flag in ("1", "0"):
        out = tmp_path / f"run{flag}.json"
        args = ["--workload", "chat", "--policies", "plas", "--profile", "h100", "--num-kv-blocks", "200"]
        args += ["--rates", "4", "--num-programs", "24", "--instances", "4", "--num-scheduler-steps", "8"]
        args += ["--sync-interval-s", "0.02", "--workers", "2", "--pipeline", "--no-progress", "--json", str(out)]
        code = f"import sys; from boundless.cli import main; sys.exit(main({['simulate', *args]!r}))"
        _python(code, BOUNDLESS_COMPILED=flag)
        result = json.loads(out.read_text())
        result.pop("speed")
        rows[flag] = result
    assert rows["1"]["rows"] and rows["1"] == rows["0"]
