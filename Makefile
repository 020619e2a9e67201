# One entry point per job; each installs what it needs into .venv first.
#   make test         lint + C++ tests + a bare install's check + the whole pytest suite
#                     (what CI runs; installs .[test])
#   make bench-quick  the main job: `fastload bench --quick` on a generated dataset
#                     (installs .[bench] only; ~3 min; prints the load average)
#   make bench        the full benchmark
#   make bench-peers  .venv-peers: the peers that need torchvision (mosaicml-streaming,
#                     litdata; ~5.5 GB with CUDA torch); `make bench` then measures them too
#   make lint / make format
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NATIVE_SOURCES := $(wildcard native/*.cpp native/*.hpp native/tests/*.cpp)

.PHONY: build-deps install install-bench check-bare-install test test-native lint format \
	bench bench-quick bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch for this machine, and the build tools: fastload builds without isolation.
build-deps: $(BIN)/python
	scripts/install-torch $(BIN)/python
	$(BIN)/python -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.4" cmake ninja

# For `make test`: the test extra (pytest, linters, moto, zarr, DALI, matplotlib, ...).
install: build-deps
	$(BIN)/python -m pip install -q clang-format
	$(BIN)/python -m pip install -q --no-build-isolation ".[test]"

# For `make bench-quick` and `make bench`: what `fastload bench` runs, nothing else.
install-bench: build-deps
	$(BIN)/python -m pip install -q --no-build-isolation ".[bench]"

# `pip install fastload` with no extras, in a fresh venv under build/: imports, --version,
# `fastload warm` of a local folder, and s3:// naming its extra.
check-bare-install:
	scripts/check-bare-install $(PYTHON)

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	cd src && ../$(BIN)/lint-imports --no-cache ../pyproject.toml
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

test: lint test-native check-bare-install
	$(BIN)/python -m pytest

bench-quick: install-bench
	$(BIN)/fastload bench --quick

bench: install-bench
	$(BIN)/fastload bench

# datasets (Hugging Face, the Parquet benchmark's peer) with a hub that mosaicml-streaming's
# transformers accepts, and the s3fs that matches the fsspec datasets caps.
bench-peers:
	PYTHON=$(PYTHON) scripts/bench-peers .venv-peers
	.venv-peers/bin/python -m pip install -q datasets "huggingface-hub<1.0" s3fs \
		|| echo "bench-peers: could not install datasets; the Parquet benchmark will skip it"

clean:
	rm -rf build fastload-bench .pytest_cache .mypy_cache .ruff_cache
