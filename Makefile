# One entry point per job; each installs what it needs into .venv first.
#   make test         lint + C++ tests + the whole pytest suite (what CI runs)
#   make bench-quick  the main job: `fastload bench --quick` on a generated dataset
#   make bench        the full benchmark
#   make bench-peers  .venv-peers: the peers that need torchvision (mosaicml-streaming,
#                     litdata; ~5.5 GB with CUDA torch); `make bench` then measures them too
#   make lint / make format
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NATIVE_SOURCES := $(wildcard native/*.cpp native/*.hpp native/tests/*.cpp)

.PHONY: install test test-native lint format bench bench-quick bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	scripts/install-torch $(BIN)/python
	$(BIN)/python -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.4" cmake ninja clang-format
	$(BIN)/python -m pip install -q --no-build-isolation ".[test]"

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/clang-format --dry-run --Werror $(NATIVE_SOURCES)

format: install
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/clang-format -i $(NATIVE_SOURCES)

# The C++ core alone, with AddressSanitizer and UndefinedBehaviorSanitizer.
test-native: install
	$(BIN)/cmake -S native -B build/native-tests -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(BIN)/ninja) \
		-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all"
	$(BIN)/cmake --build build/native-tests
	$(BIN)/ctest --test-dir build/native-tests --output-on-failure

test: lint test-native
	$(BIN)/python -m pytest

# The bench extra (matplotlib, for the chart), without reinstalling fastload itself.
BENCH_EXTRA := "matplotlib>=3.7"

bench-quick: install
	$(BIN)/python -m pip install -q $(BENCH_EXTRA)
	$(BIN)/fastload bench --quick

bench: install
	$(BIN)/python -m pip install -q $(BENCH_EXTRA)
	$(BIN)/fastload bench

bench-peers: install
	PYTHON=$(PYTHON) scripts/bench-peers .venv-peers

clean:
	rm -rf build fastload-bench .pytest_cache .mypy_cache .ruff_cache
