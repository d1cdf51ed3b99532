"""The engine's hot modules compiled to C with mypyc, loaded in place of their source when built from it.

The scheduler, the KV cache bookkeeping, the dispatcher and the simulator's loop run Python for every call and every
step; a simulated cluster of a thousand instances spends nearly all of its time there. mypyc compiles these modules,
as they are written (their type hints are the compiler's input), into C extensions: the classes become C structs,
the calls between them C calls. The source stays the one copy; the build is a cache of it.

- :func:`main` (``make`` runs it before serving or testing) builds :data:`MODULES` with mypyc into the cache directory
  (``$BOUNDLESS_CACHE_DIR`` or ``~/.cache/boundless``), under a key made of the modules' sources and the Python
  build; nothing to do when that build exists.
- :func:`install` (``boundless/__init__.py``, first thing) puts a finder before the source's when the build of the
  modules as they are now exists: an edited module, a missing build, ``BOUNDLESS_COMPILED=0``, no compiler on the
  machine: the source runs, as it always can (the same results; ``tests/test_compiled.py`` compares them).

The modules are built as one group (calls between them bind at compile time), so one edited module drops the whole
build until it is built again.
"""

from __future__ import annotations

import copyreg
import dataclasses
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# Compiled together; an interpreted class may not subclass a compiled one, so a subclass's module is here too. Not
# here: the engine core, whose methods tools and tests wrap on its instances (a compiled class has no instance
# dictionary), and which costs a simulated step little (measured: the same run with the core compiled).
MODULES: tuple[str, ...] = (
    "boundless.kv.block_hash",
    "boundless.kv.block_pool",
    "boundless.kv.eviction",
    "boundless.kv.manager",
    "boundless.engine.request",
    "boundless.engine.scheduler",
    "boundless.engine.attention_time",
    "boundless.programs.process_table",
    "boundless.programs.policies",
    "boundless.cluster.routing",
    "boundless.cluster.dispatcher",
    "boundless.cluster.pd_dispatcher",
    "boundless.bench.workloads",
    "boundless.sim.executor",
    "boundless.sim.profiles",
    "boundless.sim.simulator",
    "boundless.sim.parallel",
)

_PACKAGE_DIR = Path(__file__).resolve().parent
_FORMAT = "1"  # bumped when the build's layout changes
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
_DONE = "complete"  # written last: a build cut off midway is not used


def enabled() -> bool:
    """Whether compiled modules may be loaded (``BOUNDLESS_COMPILED=0`` keeps to the source)."""
    return os.environ.get("BOUNDLESS_COMPILED", "1").lower() not in ("0", "false", "no", "off")


def cache_root() -> Path:
    """Where builds from this package's sources are kept (``$BOUNDLESS_CACHE_DIR``, else the user's cache)."""
    root = os.environ.get("BOUNDLESS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "boundless"
    )
    return Path(root)


def _source(name: str) -> Path:
    return _PACKAGE_DIR.parent.joinpath(*name.split(".")).with_suffix(".py")


def build_key(modules: Sequence[str] = MODULES) -> str:
    """The modules' sources and the Python ABI they are compiled for (a minor version's, which its patch releases
    keep: a build made with 3.12.1 loads in 3.12.3, as the GPU machine's check carries one), hashed: a build's
    directory name."""
    abi = f"{sys.implementation.cache_tag}|{_SUFFIX}|{platform.machine()}"
    digest = hashlib.sha256(f"{_FORMAT}|{abi}".encode())
    for name in modules:
        digest.update(name.encode() + b"\0" + _source(name).read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build_dir(modules: Sequence[str] = MODULES) -> Path:
    return cache_root() / "compiled" / build_key(modules)


def _extension(root: Path, dotted: str) -> Path:
    return root.joinpath(*dotted.split(".")).with_name(dotted.rsplit(".", 1)[-1] + _SUFFIX)


def _rebuild_frozen(cls: type, state: dict[str, object]) -> object:
    obj = cls.__new__(cls)
    for name, value in state.items():
        object.__setattr__(obj, name, value)  # (past the frozen class's own __setattr__, as its __init__ goes)
    return obj


def _reduce_frozen(obj: object) -> tuple[object, ...]:
    return _rebuild_frozen, (type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})  # type: ignore[arg-type]


class _CompiledLoader(importlib.machinery.ExtensionFileLoader):
    """Loads a compiled module, then has the frozen dataclasses of every compiled module loaded so far pickle by their
    fields: mypyc's own pickling sets the attributes one by one, which a frozen dataclass refuses (pipes to the
    simulator's workers, Ray's calls). Every one loaded so far, each time: a compiled module's imports of the others in
    its group run their code directly, not through this loader, and a module may be half run when another ends (an
    import cycle); the import that started a chain ends last, with every module in it run."""

    def __init__(self, fullname: str, path: str, modules: frozenset[str]) -> None:
        super().__init__(fullname, path)
        self.modules = modules

    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        for name in self.modules:
            if (loaded := sys.modules.get(name)) is not None:
                _pickle_frozen_by_fields(loaded)


def _pickle_frozen_by_fields(module: ModuleType) -> None:
    for value in list(vars(module).values()):
        if (
            isinstance(value, type)
            and value.__module__ == module.__name__
            and dataclasses.is_dataclass(value)
            and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
        ):
            copyreg.pickle(value, _reduce_frozen)


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled build of :data:`MODULES` (and the group's runtime library, a top-level module mypyc names
    ``<hash>__mypyc``) in ``root``; every other import goes on to the next finder."""

    def __init__(self, root: Path, modules: Sequence[str] = MODULES) -> None:
        self.root = root
        self.modules = frozenset(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.modules or (fullname.endswith("__mypyc") and "." not in fullname):
            file = _extension(self.root, fullname)
            if file.is_file():
                loader = _CompiledLoader(fullname, str(file), self.modules)
                return importlib.util.spec_from_file_location(fullname, file, loader=loader)
        return None


def installed() -> CompiledFinder | None:
    """The finder :func:`install` put in place, if any."""
    return next((f for f in sys.meta_path if isinstance(f, CompiledFinder)), None)


def install() -> bool:
    """Load :data:`MODULES` from their build, where one of their current sources exists; whether it does. Before any of
    them is imported (a module imported already stays as it is)."""
    if installed() is not None:
        return True
    if not enabled():
        return False
    try:
        root = build_dir()
    except OSError:  # a source not readable: the package is not laid out as built
        return False
    if not (root / _DONE).is_file():
        return False
    sys.meta_path.insert(0, CompiledFinder(root))
    return True


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from a compiled build."""
    finder = installed()
    file = getattr(module, "__file__", None) or ""
    # (Not by its ``__spec__``'s loader: a compiled module's group sets its own.)
    return finder is not None and module.__name__ in finder.modules and Path(file).is_relative_to(finder.root)


def build(modules: Sequence[str] = MODULES) -> Path:
    """Compile ``modules`` with mypyc into their build directory (nothing to do if it is there); the directory. Raises
    ``RuntimeError`` when mypyc or the C compiler fails (with its output)."""
    dest = build_dir(modules)
    if (dest / _DONE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="boundless-mypyc-") as tmp:
        work = Path(tmp) / "src"
        # The package as it is (mypyc reads the modules it does not compile for their types), no earlier outputs.
        shutil.copytree(_PACKAGE_DIR, work / "boundless", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
        # Installed packages (torch above all) are not read: their types count as Any, and mypy is spared minutes.
        cmd = [sys.executable, "-m", "mypyc", "--no-site-packages", "--ignore-missing-imports"]
        cmd += ["--follow-imports=silent"]  # (the modules not compiled are read for their types, not checked)
        cmd += [str(Path("boundless", *m.split(".")[1:]).with_suffix(".py")) for m in modules]
        env = {**os.environ, "MYPYC_OPT_LEVEL": os.environ.get("MYPYC_OPT_LEVEL", "3")}
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"mypyc failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr}")
        # Gathered beside its place, on the same file system (the temporary directory is often another: a tmpfs),
        # so that the rename that puts it there is one step.
        # (os.mkdir, not mkdtemp, whose 0700 the build would keep: a cache others read must stay readable.)
        out = dest.parent / f".{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        out.mkdir()
        try:
            for name in modules:
                target = _extension(out, name)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(_extension(work, name), target)
            for lib in work.glob(f"*__mypyc{_SUFFIX}"):
                shutil.copy2(lib, out / lib.name)
            (out / _DONE).write_text(" ".join(modules) + "\n")
            try:
                os.rename(out, dest)  # all at once: a reader finds the whole build or none
            except OSError:
                if not (dest / _DONE).is_file():  # (another build of the same sources won the race: fine)
                    raise
        finally:
            shutil.rmtree(out, ignore_errors=True)  # (nothing left where the rename took it)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    """Build the modules (``make`` runs this); a failure is reported and leaves the source to run."""
    import argparse

    parser = argparse.ArgumentParser(prog="boundless.compiled", description=main.__doc__)
    parser.add_argument("--strict", action="store_true", help="exit non-zero when the build fails")
    args = parser.parse_args(argv)
    try:
        import mypyc  # noqa: F401
    except ImportError:
        print("boundless.compiled: mypyc is not installed; the modules run from source", file=sys.stderr)
        return 1 if args.strict else 0
    try:
        dest = build()
    except (RuntimeError, OSError) as e:
        print(f"boundless.compiled: build failed, the modules run from source: {e}", file=sys.stderr)
        return 1 if args.strict else 0
    print(f"boundless.compiled: {len(MODULES)} modules built in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
