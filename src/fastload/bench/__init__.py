"""Benchmarks that run fastload side by side with the tools users would pick instead.

``runner`` holds what every benchmark shares (timing, machine description, JSON and table
output); each ``<stage>_bench`` module measures one stage. ``benchmarks/`` at the repository
root has one small script per benchmark with the exact command in its docstring.
"""
