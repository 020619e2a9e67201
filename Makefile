# One entry point per job; each installs what it needs into .venv first.
#   make test         lint + C++ tests + a bare install's check + the whole pytest suite
#                     (what CI runs; installs .[test])
#   make bench-quick  the main job: `fastload bench --quick` on a generated dataset
#                     (installs .[bench] only; ~3 min; prints the load average)
#   make bench        the full benchmark
#   make bench-peers  .venv-peers: the peers that need torchvision (mosaicml-streaming,
#                     litdata; ~5.5 GB with CUDA torch); `make bench` then measures them too
#   make wheel        binary wheels into dist/ (native paths inside, libjpeg-turbo vendored)
#   make check-wheel  each wheel into a fresh venv with no compiler, on 3.11, 3.12 and 3.13
#   make lint / make format
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NATIVE_SOURCES := $(wildcard native/*.cpp native/*.hpp native/tests/*.cpp)

.PHONY: build-deps install install-bench check-bare-install test test-native lint format \
	bench bench-quick bench-peers clean wheel check-wheel check-wheel-ci

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

# Binary wheels (scripts/build-wheel): cp311, and one abi3 wheel for 3.12 and later.
wheel:
	scripts/build-wheel $(PYTHON)
	scripts/build-wheel $$(scripts/find-python 3.12)

# Each wheel into a fresh venv without a compiler (scripts/check-wheel), each with torch and a
# loader epoch resumed mid-way: 3.11 with torch's CPU build, 3.12 and 3.13 with PyPI's (the
# CUDA build: 4.7 GB each, removed afterwards; 2.4 min on a quiet machine, 4.7 min at load
# 15; the CPU index is out of reach here).
check-wheel: wheel
	scripts/check-wheel $(PYTHON)
	scripts/check-wheel $$(scripts/find-python 3.12)
	scripts/check-wheel $$(scripts/find-python 3.13)

# What `make test` runs (~6-11 min, most of it torch's download): the abi3 wheel, built and
# smoke-tested on 3.12 and 3.13, a loader epoch with resume included (3.11 has the whole suite
# and the bare install from source).
check-wheel-ci:
	scripts/build-wheel $$(scripts/find-python 3.12)
	scripts/check-wheel $$(scripts/find-python 3.12)
	scripts/check-wheel $$(scripts/find-python 3.13)

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

test: lint test-native check-bare-install check-wheel-ci
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
