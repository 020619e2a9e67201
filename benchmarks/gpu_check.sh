#!/usr/bin/env bash
# One command for a GPU machine: decode images/s (DALI mixed, fastload's CPU path, CPU decode +
# GPU transforms, DALI's own pipeline), host->device bandwidth (pageable, pinned peak, the
# DeviceRing) and a simulated training step with and without the data path overlapped; the
# loader in 1 and N rank processes (per-rank img/s, cores per GPU); fastload doctor on CUDA.
# Needs no network; sized for under 4 minutes on one H200, every section (not yet timed there
# since the ranks and doctor sections were added; --quick: about a minute).
# Runs on .venv/bin/python (make install) or on a python3 whose torch has CUDA, with this
# checkout's sources; that interpreter needs fastload's dependencies (simplejpeg for the CPU
# rows) and, for the DALI rows, nvidia-dali-cuda130; what is missing is reported per row.
#
#   benchmarks/gpu_check.sh [--quick] [--out DIR] [more options: --help]
#
# Writes DIR/gpu_check.json and keeps its generated JPEGs in DIR/data. DIR defaults to
# $OUT/gpu-check when $OUT is set, else fastload-bench/gpu-check in the repository; nothing is
# written anywhere else. Exit status: 0 all measured, 1 a measurement failed (the rest are
# still written), 2 no CUDA device or bad usage. See fastload/bench/gpu/gpu_check.py.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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

venv="$root/.venv/bin/python"
candidates=()
[ -x "$venv" ] && candidates+=("$venv")
command -v python3 >/dev/null 2>&1 && candidates+=(python3)
# The first interpreter whose torch sees a CUDA device, else the first with torch at all (it
# then says why there is no device). Offline, make install leaves a venv without torch (or a
# carried one has the CPU build): it must not shadow a python3 that has CUDA torch.
python=""
for probe in 'import sys, torch; sys.exit(not torch.cuda.is_available())' 'import torch'; do
  for candidate in ${candidates[@]+"${candidates[@]}"}; do
    if "$candidate" -c "$probe" >/dev/null 2>&1; then
      python="$candidate"
      break 2
    fi
  done
done
if [ -z "$python" ]; then
  echo "gpu_check.sh: no Python with torch (tried: ${candidates[*]:-none}); run make install" >&2
  exit 2
fi
if [ "$python" != "$venv" ]; then
  # Not the venv: run this checkout's sources (the native reader then falls back to Python).
  export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
fi

json="$out/gpu_check.json"
rm -f "$json"
status=0
"$python" -m fastload.bench.gpu.gpu_check --out "$out" ${args[@]+"${args[@]}"} || status=$?
if [ -f "$json" ]; then
  echo "gpu_check.sh: results in $json"
elif [ "$status" -eq 0 ]; then
  echo "gpu_check.sh: no results were written to $json" >&2
  status=1
fi
exit "$status"
