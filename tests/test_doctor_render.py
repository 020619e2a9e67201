"""The doctor's table, doctor.json and PNG, from reports built by hand (nothing measured)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fastload.diagnosis import render
from fastload.diagnosis.report import SCHEMA_VERSION, Applied, Fix, Phase, Report, Verdict

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_report(*, price: float | None = 2.05, applied: bool = False) -> Report:
    """A decode-bound run: 2 threads, a 20 ms step, a cold remote, no GPU for the h2d phase."""
    phases = {
        "ceiling": Phase(
            "ceiling", "the step alone", 50, 3200, 1.0, 3200.0, step_s=0.020, cpu_cores=0.01
        ),
        "prep": Phase(
            "prep",
            "the loader alone, warm cache",
            50,
            3200,
            3.54,
            905.1,
            wait_s=0.0707,
            cpu_cores=1.96,
            stage_s={"read": 0.004, "decode": 0.130, "collate": 0.006},
        ),
        "train": Phase(
            "train",
            "loader + step, warm cache",
            50,
            3200,
            3.64,
            880.0,
            step_s=0.0201,
            wait_s=0.0526,
            cpu_cores=1.98,
            stage_s={"read": 0.004, "decode": 0.131, "collate": 0.006},
        ),
        "cold": Phase(
            "cold",
            "loader + step, cold remote",
            50,
            3200,
            10.3,
            310.2,
            step_s=0.0202,
            wait_s=0.186,
            cpu_cores=0.9,
            stage_s={"read": 0.004, "decode": 0.13, "collate": 0.006, "stage": 0.35},
            bytes_fetched=320_000_000,
        ),
        "h2d": Phase("h2d", "host to device copy", skipped="no CUDA device on this machine"),
    }
    with_price = price is not None
    fixes = [
        Fix(
            "num_workers",
            {"num_workers": 4},
            "decode takes 65 ms a batch on each of 2 threads; 4 threads share it",
            1628.0,
            0.51,
            7.4,
            0.034 if with_price else None,
            1.85,
        ),
        Fix(
            "cores",
            {"cores": 16},
            "more cores per rank would let more threads decode",
            2900.0,
            0.9,
            4.1,
            0.019 if with_price else None,
            3.3,
            applicable=False,
        ),
        Fix(
            "warm",
            {},
            "the first epoch fetches from the remote at 310 samples/s",
            880.0,
            0.27,
            13.6,
            None,
            1.0,
            command="fastload warm s3://bucket/train",
        ),
    ]
    return Report(
        schema=SCHEMA_VERSION,
        fastload_version="0.0.0-test",
        url="s3://bucket/train",
        dataset={"samples": 12_000, "bytes": 1_200_000_000, "format": "folder"},
        loader={"batch_size": 64, "num_workers": 2, "decode": "cpu", "transform": "train"},
        node={"cores": 16, "local_world_size": 8, "world_size": 8, "gpu": "A100"},
        step={"kind": "sleep", "ms": 20},
        price={"gpu": "A100", "usd_per_gpu_hour": price, "gpus": 8 if with_price else None},
        phases=phases,
        bottleneck="decode",
        verdict=Verdict(
            utilization=0.27,
            samples_per_s=880.0,
            ceiling_samples_per_s=3200.0,
            epoch_s=13.6,
            epoch_usd=0.062 if with_price else None,
            lost_usd_per_epoch=0.045 if with_price else None,
            lost_usd_per_day=None,
            basis="train",
            summary="the step waits 73% of the time for decoding",
        ),
        fixes=fixes,
        applied=Applied(
            "num_workers",
            {"num_workers": 4},
            1628.0,
            1590.0,
            0.51,
            0.50,
            1590.0 / 1628.0 - 1,
            phase=Phase(
                "train",
                "loader + step, warm cache, num_workers=4",
                50,
                3200,
                2.0,
                1590.0,
                step_s=0.0201,
                wait_s=0.020,
                cpu_cores=3.9,
                stage_s={"read": 0.004, "decode": 0.131, "collate": 0.006},
            ),
        )
        if applied
        else None,
        notes=["the step is a sleep: the GPU's own speed is not measured"],
        budget_s=41.0,
    )


def test_table_names_bottleneck_phases_and_fixes() -> None:
    text = render.table(make_report())
    print(text)
    assert text.startswith("fastload doctor: s3://bucket/train (12,000 samples, 1.2 GB, folder)")
    assert "bottleneck: decode" in text
    assert "the step waits 73% of the time" in text
    lines = text.splitlines()
    # the phases in measuring order; the stage columns that some phase has, "stage" as fetch
    header = next(line for line in lines if line.startswith("phase"))
    assert header.split() == [
        "phase", "samples/s", "step", "ms", "wait", "ms", "read", "ms", "decode", "ms",
        "collate", "ms", "fetch", "ms", "cores",
    ]  # fmt: skip
    assert "transfer" not in header
    train = next(line for line in lines if line.startswith("train "))
    assert train.split()[:4] == ["train", "880.0", "20.1", "52.6"]
    assert next(line for line in lines if line.startswith("ceiling ")).split()[3] == "-"
    skipped = next(line for line in lines if line.startswith("h2d "))
    assert "skipped: no CUDA device on this machine" in skipped
    # each fix with its gain and predicted samples/s, in rank order
    first = next(line for line in lines if line.lstrip().startswith("1."))
    assert "num_workers=4" in first
    assert "1.85x" in first
    assert "1,628 samples/s" in first
    assert "utilization 51%" in first
    assert "$0.034 an epoch" in first
    second = next(line for line in lines if line.lstrip().startswith("2."))
    assert "cores=16" in second
    assert "3.30x" in second
    second_block = text[text.index(second) : text.index("  3. ")]
    assert "(not applicable here)" in second_block
    assert "(not applicable" not in first
    assert "run: fastload warm s3://bucket/train" in text
    assert "$0.062 an epoch, $0.045 of it waiting" in text
    assert "$2.05/GPU-hour" in text
    assert "applied" not in text
    assert lines[-1] == "note: the step is a sleep: the GPU's own speed is not measured"
    assert all(len(line) <= 100 for line in lines), [line for line in lines if len(line) > 100]
    assert "\x1b" not in text


def test_table_without_price_shows_dash_and_why() -> None:
    text = render.table(make_report(price=None))
    assert "cost - (no GPU price)" in text
    assert "no GPU price" in next(line for line in text.splitlines() if line.startswith("step:"))
    assert "$" not in text
    first = next(line for line in text.splitlines() if line.lstrip().startswith("1."))
    assert first.rstrip().endswith("utilization 51%")


def test_table_with_applied_gives_predicted_vs_measured() -> None:
    text = render.table(make_report(applied=True))
    line = next(line for line in text.splitlines() if line.startswith("applied"))
    assert line.startswith(
        "applied num_workers=4: predicted 1,628 samples/s, measured 1,590 (-2.3%)"
    )
    assert "utilization predicted 51%, measured 50%" in text


@pytest.mark.parametrize(
    ("amount", "shown"),
    [
        (None, "-"),
        (0.0, "$0"),
        (0.0620, "$0.062"),
        (0.04567, "$0.0457"),
        (2.05, "$2.05"),
        (12.345, "$12.35"),
        (1234.5, "$1,234"),
    ],
)
def test_dollars_to_three_figures(amount: float | None, shown: str) -> None:
    assert render._usd(amount) == shown


@pytest.mark.parametrize("applied", [False, True])
def test_write_json_and_png(tmp_path: Path, applied: bool) -> None:
    report = make_report(applied=applied)
    out = tmp_path / "out" / "nested"
    lines = render.write(report, out)
    assert lines == [f"wrote {out / 'doctor.json'}", f"wrote {out / 'doctor.png'}"]
    saved = json.loads((out / "doctor.json").read_text())
    assert saved["bottleneck"] == "decode"
    assert saved["schema"] == SCHEMA_VERSION
    assert saved["chart"] == str(out / "doctor.png")
    assert saved["phases"]["h2d"]["skipped"] == "no CUDA device on this machine"
    assert (saved["applied"] is not None) is applied
    assert (out / "doctor.png").read_bytes().startswith(PNG_SIGNATURE)
    assert sorted(p.name for p in out.iterdir()) == ["doctor.json", "doctor.png"]  # no tmp left


def test_write_without_chart(tmp_path: Path) -> None:
    report = make_report()
    assert render.write(report, tmp_path, with_chart=False) == [f"wrote {tmp_path / 'doctor.json'}"]
    assert json.loads((tmp_path / "doctor.json").read_text())["chart"] is None
    assert not (tmp_path / "doctor.png").exists()


def test_chart_bars_share_stage_time_over_threads() -> None:
    report = make_report(applied=True)
    now = render._now_bars(report)
    assert now["step"] == pytest.approx(20.0)
    assert now["decode"] == pytest.approx(130.0 / 2)  # prep's decode on 2 threads
    assert now["fetch"] == pytest.approx(350.0 / 2)  # cold's stage
    assert now["per batch"] == pytest.approx(64 * 1000 / 880.0)  # the basis: train
    assert "h2d" not in now  # skipped
    after = render._after_bars(report)
    assert after["decode"] == pytest.approx(131.0 / 4)  # the fix's 4 threads
    assert after["per batch"] == pytest.approx(64 * 1000 / 1590.0)


def test_chart_without_matplotlib_is_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "doctor.png"
    note = render.chart(make_report(), png)
    assert note is not None
    assert "pip install" in note
    assert "\n" not in note
    assert not png.exists()
    report = make_report()
    lines = render.write(report, tmp_path)
    assert lines[1] == note
    assert report.chart is None
    assert json.loads((tmp_path / "doctor.json").read_text())["chart"] is None
    assert not png.exists()


def test_nothing_measured_still_renders(tmp_path: Path) -> None:
    """A run whose phases all skipped (no step, no data): a table and JSON, a note for the chart."""
    report = make_report(price=None)
    report.phases = {name: Phase(name, "", skipped=f"{name} did not run") for name in report.phases}
    report.fixes = []
    report.verdict.samples_per_s = 0.0
    report.loader = {}
    text = render.table(report)
    assert "ceiling  skipped: ceiling did not run" in text
    assert "fixes: none found" in text
    assert "stage ms" not in text
    lines = render.write(report, tmp_path)
    assert lines[1].startswith("no chart:")
    assert json.loads((tmp_path / "doctor.json").read_text())["chart"] is None
    assert not (tmp_path / "doctor.png").exists()
