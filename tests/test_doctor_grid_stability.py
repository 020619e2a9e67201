"""The doctor grid benchmark's verdict stability figure, on records given to it: the
share of a configuration's repeated runs naming its most common bottleneck."""

from __future__ import annotations

from fastload.bench.components.doctor_grid_bench import lines, stability


def test_the_share_naming_the_same_bottleneck_per_configuration() -> None:
    records = [{"name": "a", "bottleneck": "decode"}] * 9 + [{"name": "a", "bottleneck": "fetch"}]
    records += [{"name": "b", "bottleneck": "fetch"}] * 7 + [{"name": "b", "bottleneck": "gil"}] * 3
    held = stability(records)
    assert held["configurations"] == 2
    assert held["per_configuration"]["a"] == {
        "runs": 10,
        "named": {"decode": 9, "fetch": 1},
        "identical": 0.9,
    }
    assert held["per_configuration"]["b"]["identical"] == 0.7
    assert held["stable_9_of_10"] == 1
    assert held["mean_identical"] == 0.8
    summary = {
        "configurations": 2,
        "runs": 0,
        "errors": {},
        "top_fix_is_best_measured": "0 of 0",
        "verdict_agreement_over_repeats": None,
        "confidence_median": None,
        "verdict_stability": held,
    }
    assert any("1 of 2 configurations" in line for line in lines(summary))
