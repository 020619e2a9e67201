"""fastload doctor: predicted samples/s after the top fix against what --apply measures (P12).

Command (five scenarios on the bench's 600 generated JPEGs over loopback S3, each one
``fl.doctor(..., apply=True)``, then a whole diagnosis timed; ~2 min on a 2-core VM)::

    .venv/bin/python benchmarks/benchmark_doctor.py --out fastload-bench

Add ``--quick`` for phases of 2 s instead of 4 (about 1 min). Writes
``doctor.json`` into ``--out`` and each scenario's whole report into ``--out``/doctor/,
and prints a table, a line per scenario and P12's targets, each met or missed.
"""

from __future__ import annotations

import argparse

from fastload.bench.components import doctor_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    settings = doctor_bench.DoctorBenchConfig
    config = settings.quick() if args.quick else settings()
    report = doctor_bench.run(args.out, config)
    print(report.table())
    print("\n".join(doctor_bench.target_lines(report)))
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
