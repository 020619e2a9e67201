"""Benchmarks that run fastload side by side with the tools users would pick instead.

Grouped by what they measure: ``e2e/`` (``fastload bench``: end to end from S3),
``components/`` (one ``<stage>_bench`` per stage of the data path), ``scale/`` (opening an
ImageNet-sized dataset), ``gpu/`` (the check for a GPU machine); ``peers/`` holds the peers'
set-ups they share. ``runner`` holds what every benchmark shares (timing, machine
description, JSON and table output); ``doctor_data`` the generated dataset ``fastload doctor``
reads when given no URL. ``benchmarks/`` at the repository root has one small script per
benchmark with the exact command in its docstring.
"""
