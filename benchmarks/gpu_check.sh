#!/usr/bin/env bash
# One command for a GPU machine: decode images/s (DALI mixed, fastload's CPU path, CPU decode +
# GPU transforms, DALI's own pipeline), host->device bandwidth (pageable, pinned peak, the
# DeviceRing) and a simulated training step with and without the data path overlapped.
# Needs no network; under 5 minutes on one H200 (--quick: about a minute).
#
#   benchmarks/gpu_check.sh [--quick] [--out DIR] [more options: --help]
#
# Writes DIR/gpu_check.json and keeps its generated JPEGs in DIR/data. DIR defaults to
# $OUT/gpu-check when $OUT is set, else fastload-bench/gpu-check in the repository; nothing is
# written anywhere else. Exit status: 0 all measured, 1 a measurement failed (the rest are
# still written), 2 no CUDA device or bad usage. See fastload/bench/gpu_check.py.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$root/.venv/bin/python"
if [ ! -x "$python" ]; then
  python=python3
  # No venv: run this checkout's sources (the native reader then falls back to Python).
  export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
fi

out=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out)
      [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a directory" >&2; exit 2; }
      out="$2"
      shift 2
      ;;
    --out=*) out="${1#--out=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -z "$out" ]; then
  out="${OUT:+$OUT/gpu-check}"
  out="${out:-$root/fastload-bench/gpu-check}"
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# Caches that CUDA and other libraries would put under $HOME go under the output instead.
export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$out/.cache/nv}"
export XDG_CACHE_HOME="$out/.cache"

json="$out/gpu_check.json"
rm -f "$json"
status=0
"$python" -m fastload.bench.gpu_check --out "$out" ${args[@]+"${args[@]}"} || status=$?
if [ -f "$json" ]; then
  echo "gpu_check.sh: results in $json"
elif [ "$status" -eq 0 ]; then
  echo "gpu_check.sh: no results were written to $json" >&2
  status=1
fi
exit "$status"
