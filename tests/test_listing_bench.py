"""The throttled-listing benchmark at toy size: both listings complete and agree (the
benchmark raises otherwise), the refused pages are counted, and each costs one more page."""

from __future__ import annotations

from fastload.bench.components.listing_bench import ListingBenchConfig, run


def test_a_small_throttled_listing_costs_one_page_more_per_refusal() -> None:
    report = run(ListingBenchConfig(objects=6_000, classes=3, fault_rate=0.3, seed=1))
    clean, throttled = (row.extra for row in report.rows)
    assert clean["refused"] == 0
    assert throttled["refused"] >= 1
    assert throttled["pages"] == clean["pages"] + throttled["refused"]
