"""Per-stage benchmarks (``fastload bench --components``): one module per stage measured,
each with its ``benchmarks/benchmark_<x>.py`` entry point."""
