"""The check run on a machine with a GPU (``benchmarks/gpu_check.sh``)."""
