"""fastload doctor on its held-out grid: every recommended fix applied and measured (#35).

Command (24 configurations, each one ``fl.doctor(..., apply=True)`` of ~15-40 s on a
2-core VM; the held-out seed is taken from the commit that added doctor_grid.py)::

    .venv/bin/python benchmarks/benchmark_doctor_grid.py --out fastload-bench

``--cache STATE`` only the configurations with that cache state; ``--development``
runs the grid the model may be tuned on (seed 35) instead; ``--points N``
the first N configurations; ``--repeats R`` each configuration R times with every fix
applied (0: none); ``--verdict-repeats 10`` each configuration's diagnosis alone 10 more
times (phases of ``--verdict-phase-s``): the share naming the same bottleneck. The
stability alone, on the first 4 configurations (~10 min)::

    .venv/bin/python benchmarks/benchmark_doctor_grid.py --repeats 0 --verdict-repeats 10 \
        --points 4 --verdict-phase-s 1

Writes ``doctor-grid-<seed>.jsonl`` (a record per run), ``doctor-verdicts-<seed>.jsonl``
and ``.json`` (the error distribution per fix type, the verdicts' stability) into
``--out``.
"""

from __future__ import annotations

import argparse

from fastload.bench.components import doctor_grid_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--development", action="store_true")
    parser.add_argument("--points", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--verdict-repeats", type=int, default=0)
    parser.add_argument("--verdict-phase-s", type=float, default=None)
    parser.add_argument("--phase-s", type=float, default=1.5)
    parser.add_argument("--cache", choices=["cold", "warm", "budget"], help="only these")
    args = parser.parse_args()
    config = doctor_grid_bench.GridBenchConfig(
        seed=args.seed,
        points=args.points,
        phase_s=args.phase_s,
        repeats=args.repeats,
        verdict_repeats=args.verdict_repeats,
        verdict_phase_s=args.verdict_phase_s,
        development=args.development,
        cache=args.cache,
    )
    summary = doctor_grid_bench.run(args.out, config)
    print(f"seed {summary['seed']} ({summary['seed_from']})")
    print("\n".join(doctor_grid_bench.lines(summary)))


if __name__ == "__main__":
    main()
