"""A measured phase of the doctor built by hand (batches of ``B``), for the tests that
check the model's decisions without running a loader."""

from __future__ import annotations

from fastload.diagnosis.report import Phase

B = 64


def phase(
    name: str,
    rate: float,
    *,
    cores: float = 1.0,
    step_ms: float | None = None,
    decode_s: float = 0.1,
    rate_se: float | None = None,
) -> Phase:
    return Phase(
        name=name,
        what=name,
        batches=10,
        samples=10 * B,
        seconds=10 * B / rate,
        samples_per_s=rate,
        step_s=None if step_ms is None else step_ms / 1000,
        cpu_cores=cores,
        stage_s={"read": 0.01, "decode": decode_s, "collate": 0.005},
        rate_se=rate_se,
    )
