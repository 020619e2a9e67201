"""From measured phases to a verdict and ranked fixes, each with its predicted figures.

The model is a roofline over one batch period ``T`` (seconds per batch, ``B`` samples):

    T >= T_step                        the step (as measured beside the loader)
    T >= B * c / u_max                 the loader's CPU work on at most u_max cores
    T >= (B * c + T_alone * s) / C     the loader and the step sharing the C cores
    T >= B / R_fetch                   fetching, from a cold cache

``c`` is the loader's CPU seconds per sample and ``u_max`` the cores its threads keep busy
(both from the ``prep`` phase: cores per thread times threads, at most the cores), ``s``
the cores the step keeps busy alone (0 for a sleeping step, 1 for one holding the GIL),
``C`` this rank's cores. Without loader threads (``num_workers=0``) the loader runs in
the step's thread: the terms add. What the model misses in the measured ``train`` phase
(hand-offs, jitter) is kept as a factor on the loader's terms, so a fix's prediction
starts from what was measured, not from the model's idea of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastload.diagnosis.cache_advice import CacheAdvice, hit_rate
from fastload.diagnosis.report import Fix, Phase, Verdict

# At or above this utilization the step is the bottleneck: nothing to fix on the data side.
SATURATED = 0.95
# A fix must predict at least this gain to be listed.
MIN_GAIN = 1.02
# The first epoch is fetch-bound when it runs below this share of the warm rate. Well below
# 1: a cold phase that overlaps its fetches runs a few percent under the warm one by noise
# alone, and a line near 1 named fetch in one run and decode in the next.
FETCH_BOUND = 0.8
# The noise of a deciding ratio is measured: the standard errors of its two rates' logs
# (each from the spread of its phase's window rates, Phase.rate_se), added in quadrature.
# A phase too short to tell counts RATE_NOISE; no ratio counts less than NOISE_FLOOR (a
# phase's windows do not see what changes between phases on a shared machine).
RATE_NOISE = 0.1
NOISE_FLOOR = 0.03
# A ratio decides a verdict across its line only when it sits this many standard errors
# from it; nearer, the verdict is its stable part (what binds once warm), and the
# confidence says how near.
DECIDE_Z = 2.0


def _se(phase: Phase | None) -> float:
    if phase is None or phase.rate_se is None:
        return RATE_NOISE
    return phase.rate_se


def ratio_noise(*phases: Phase | None) -> float:
    """The standard error of the log of a ratio of these phases' rates."""
    return max(NOISE_FLOOR, math.sqrt(sum(_se(p) ** 2 for p in phases)))


def decides(ratio: float, noise: float) -> bool:
    """Whether ``ratio`` (to its line) sits beyond the noise on either side."""
    return abs(math.log(max(ratio, 1e-9))) >= DECIDE_Z * noise


def trusted(phase: Phase | None) -> bool:
    """A phase that ran and measured enough batches to decide a verdict."""
    return phase is not None and phase.skipped is None and phase.too_few is None


@dataclass
class Measured:
    """What the phases measured, and the settings they ran with."""

    batch_size: int
    workers: int
    prefetch: int
    cores: float  # the cores this process could use when measured
    cores_per_rank: float  # the node's cores over its local world size
    prep: Phase
    ceiling: Phase
    train: Phase
    cold: Phase | None = None
    h2d: Phase | None = None
    budget: Phase | None = None  # an epoch after the first with the cache's budget
    first: Phase | None = None  # a first epoch into the budgeted cache (without a cold one)
    cached_fraction: float = 1.0  # of the measured samples' objects, in the cache already
    dataset_samples: int = 0  # this rank's share of an epoch
    share_bytes: int = 0  # this node's share of the dataset
    cache_budget: int | None = None  # the cache's byte budget (None: no limit)
    budget_policy: str = "lru"  # the cache's eviction policy
    lookahead_bytes: int = 0
    bytes_per_sample: float = 0.0
    gpus: int = 1  # GPUs the job pays for (its world size)


@dataclass(frozen=True)
class Settings:
    """The loader settings a prediction varies."""

    workers: int
    cores: float


class Model:
    """The roofline above, fitted to the measured phases."""

    def __init__(self, m: Measured) -> None:
        self.m = m
        self.B = m.batch_size
        self.step_alone = m.ceiling.step_s or 0.0
        self.step_cores = min(m.ceiling.cpu_cores, m.cores)
        # The step as it ran beside the loader (a step holding the GIL runs longer there).
        self.step = max(self.step_alone, m.train.step_s or 0.0)
        rate = max(m.prep.samples_per_s, 1e-9)
        busy = max(m.prep.cpu_cores, 1e-3)
        self.cpu_per_sample = busy / rate  # c
        self.cores_per_thread = busy / min(max(m.workers, 1), m.cores)
        self.measured_s = self.B / max(m.train.samples_per_s, 1e-9)
        # Cores other processes kept busy while the loader ran: a loaded machine's cores
        # are not all the loader's (on 2 cores with others' work running, the thread fix
        # predicted +42% more than it delivered when it counted them all).
        seen = [p.others_cores for p in (m.prep, m.train) if p.others_cores is not None]
        self.others = sum(seen) / len(seen) if seen else 0.0
        self.busy_now = m.train.cpu_cores
        # What the model misses in the train phase, fitted to it: a stall per batch on each
        # loader thread (it waits for the GIL a step holds: more threads hide it, as long
        # as cores are left), or, where the cores bind, a factor on the cores' term.
        self.stall_s = 0.0
        self.fit = 1.0
        now = Settings(m.workers, m.cores)
        if m.workers > 0 and self.measured_s > 1.02 * max(self.step, self.data_s(now)):
            if self.threads_s(now) >= self.cores_s(now):
                self.stall_s = m.workers * self.measured_s - self.work_s / self.cores_per_thread
            else:
                self.fit = min(self.measured_s / self.cores_s(now), 3.0)

    @property
    def work_s(self) -> float:
        """The loader's CPU seconds per batch."""
        return self.B * self.cpu_per_sample

    def threads_s(self, s: Settings) -> float:
        """Seconds per batch the loader's threads need, each at its measured speed."""
        return (self.work_s / self.cores_per_thread + self.stall_s) / max(s.workers, 1)

    def cores_s(self, s: Settings) -> float:
        """Seconds per batch the cores need for the loader's and the step's CPU work."""
        return (self.work_s + self.step_alone * self.step_cores) / self.usable(s.cores) * self.fit

    def usable(self, cores: float) -> float:
        """Of ``cores``, those left by other processes (at least what the job used)."""
        return max(cores - self.others, min(cores, self.busy_now), 1e-3)

    def data_s(self, s: Settings) -> float:
        """The loader's seconds per batch with the step beside it."""
        if s.workers == 0:  # in the step's thread, one after the other
            return self.work_s / min(self.cores_per_thread, s.cores)
        return max(self.threads_s(s), self.cores_s(s))

    def batch_s(self, s: Settings) -> float:
        """Seconds per batch of training (warm cache)."""
        if s.workers == 0:
            return self.step + self.data_s(s)
        return max(self.step, self.data_s(s))

    def utilization(self, batch_s: float) -> float:
        return min(1.0, self.step_alone / batch_s) if batch_s > 0 else 0.0

    def cores_needed(self) -> int:
        """Cores for this rank (one loader thread each) at which the loader keeps pace."""
        if self.step <= 0:
            return 1 << 30
        threads = self.work_s / self.cores_per_thread + self.stall_s
        cores = (self.work_s + self.step_alone * self.step_cores) * self.fit
        return math.ceil(max(threads, cores) / self.step)


def current_s(m: Measured, model: Model, basis: Phase) -> float:
    """Seconds per batch as the job runs now: as ``basis`` measured, or, where the node's
    ranks share the cores measured (a local world size above 1), as the model predicts for
    this rank's share of them."""
    measured = model.B / max(basis.samples_per_s, 1e-9)
    if m.cores_per_rank >= m.cores:
        return measured
    return max(measured, model.batch_s(Settings(m.workers, m.cores_per_rank)))


def fetch_ratio(m: Measured, basis: Phase) -> tuple[float, float] | None:
    """The basis's rate over the fetch line (FETCH_BOUND of the warm rate) and the noise
    of its log, where the basis is a cold or budget phase; else None."""
    phase = {"cold": m.cold, "budget": m.budget}.get(basis.name)
    if phase is None or not trusted(phase):
        return None
    line = max(FETCH_BOUND * m.train.samples_per_s, 1e-9)
    return phase.samples_per_s / line, ratio_noise(phase, m.train)


def fetch_near(m: Measured, basis: Phase) -> bool:
    """Whether the basis's rate is within noise of the fetch line: fetching may bind now
    or not; the verdict names what binds once warm (the stable part)."""
    found = fetch_ratio(m, basis)
    return found is not None and not decides(*found)


def fetch_bound(m: Measured, basis: Phase) -> bool:
    """Whether the first epoch (the cold basis), or an epoch after it with the cache's
    budget, waits for the remote: its rate below the line by more than the noise."""
    found = fetch_ratio(m, basis)
    return found is not None and found[0] < 1 and decides(*found)


def bottleneck(m: Measured, model: Model, basis: Phase) -> str:
    """The stage the step waits on at ``basis`` (see report.BOTTLENECKS)."""
    if model.utilization(current_s(m, model, basis)) >= SATURATED:
        return "none"
    if fetch_bound(m, basis):
        return "fetch"
    return warm_bottleneck(m, model)


def warm_bottleneck(m: Measured, model: Model) -> str:
    """What binds once the cache holds the data (the train phase)."""
    if model.utilization(model.measured_s) >= SATURATED:
        return "none"
    if m.h2d is not None and m.h2d.step_s and m.h2d.step_s >= model.measured_s * 0.5:
        return "h2d"
    if (
        m.workers > 0
        and model.step > 1.1 * model.step_alone
        and (model.step >= 0.9 * model.measured_s)
    ):
        return "gil"
    stages = {k: v for k, v in m.prep.stage_s.items() if k in ("read", "decode", "collate")}
    if not stages:
        return "read"
    return max(stages, key=lambda k: stages[k])


def confidence(m: Measured, model: Model, basis: Phase, neck: str) -> float:
    """The share of repeated runs expected to name ``neck`` again: how many of its
    measured standard errors (ratio_noise) the deciding ratio sits from where the verdict
    would change, through the normal distribution; the nearest ratio decides it. For the
    fetch line that is DECIDE_Z errors below the line: a rate within noise of the line
    names what binds once warm, on either side of it."""
    zs: list[float] = []
    util = model.utilization(current_s(m, model, basis))
    # (the ceiling is the mean of many calls of the step alone: the basis's noise binds)
    zs.append(abs(math.log(max(util / SATURATED, 1e-9))) / ratio_noise(basis))
    if neck != "none":
        found = fetch_ratio(m, basis)
        if found is not None:
            ratio, noise = found
            beyond = math.log(max(ratio, 1e-9)) / noise + DECIDE_Z  # < 0: fetch named
            zs.append(-beyond if neck == "fetch" else beyond)
        gil_close = m.workers > 0 and model.step >= 0.9 * model.measured_s
        if neck != "fetch" and gil_close and model.step_alone > 0:
            gil = model.step / (1.1 * model.step_alone)
            zs.append(abs(math.log(max(gil, 1e-9))) / ratio_noise(m.train))
    z = max(0.0, min(zs))
    return round(0.5 * (1 + math.erf(z / math.sqrt(2))), 3)


def basis_phase(m: Measured) -> Phase:
    """The phase that stands for the job as it would run now: cold while the cache does not
    hold the data (and the cold phase ran), an epoch after the first where the cache's
    budget is below the share, else the warm train phase."""
    if trusted(m.cold) and m.cached_fraction < 0.95:
        assert m.cold is not None
        return m.cold
    if trusted(m.budget):
        assert m.budget is not None
        return m.budget
    return m.train


def fixes(
    m: Measured,
    model: Model,
    basis: Phase,
    *,
    usd_per_gpu_hour: float | None,
    warm_command: str,
    dali_rate: float | None = None,
    advice: CacheAdvice | None = None,
) -> list[Fix]:
    """The fixes worth making, best predicted gain first."""
    now_s = current_s(m, model, basis)
    fetching = fetch_bound(m, basis)
    # While fetching binds, no fix of the loader beats the rate the remote delivered.
    fetch_floor = now_s if fetching else 0.0
    found: list[Fix] = []

    def add(
        name: str,
        change: dict[str, object],
        why: str,
        batch_s: float,
        *,
        command: str | None = None,
        applicable: bool = True,
        floor: bool = True,
    ) -> None:
        batch_s = max(batch_s, fetch_floor if floor else 0.0, model.step)
        found.append(
            _fix(
                name,
                change,
                why,
                batch_s,
                now_s,
                model,
                m,
                usd_per_gpu_hour,
                command=command,
                applicable=applicable,
            )
        )

    if fetching and m.cold is not None:
        add(
            "warm",
            {},
            "stage this node's share into the cache before training: the job "
            "then reads at the warm-cache rate measured (the train phase)",
            model.measured_s,
            command=warm_command,
            floor=False,
        )
        stage_s = m.cold.stage_s.get("stage")
        window = m.lookahead_bytes / max(m.bytes_per_sample * model.B, 1.0)
        if stage_s and window < 8:
            add(
                "lookahead_bytes",
                {"lookahead_bytes": int(64 * model.B * m.bytes_per_sample)},
                f"staging looks {window:.1f} batches ahead: fetches wait at each batch "
                "instead of overlapping the step",
                max(model.measured_s, stage_s),
                floor=False,
            )
    if m.budget is not None and advice is not None:  # every epoch after the first
        _cache_fixes(m, model, advice, add)
    threads = max(m.workers + 1, math.ceil(m.cores_per_rank))
    if m.workers < m.cores_per_rank or m.workers == 0:
        add(
            "num_workers",
            {"num_workers": threads},
            f"{m.workers} loader thread{'s' if m.workers != 1 else ''} on "
            f"{m.cores_per_rank:g} cores: the loader can use "
            f"{threads}"
            + (
                " (beside a step holding the GIL it has "
                f"{max(m.cores_per_rank - model.step_cores, 0):.1f} cores left)"
                if model.step_cores > 0.5
                else ""
            ),
            model.batch_s(Settings(threads, m.cores_per_rank)),
        )
    # The loader as fast as its threads and cores allow, with no stall between batches.
    unstalled = max(
        model.step,
        model.work_s / (model.cores_per_thread * max(m.workers, 1)),
        model.cores_s(Settings(m.workers, m.cores_per_rank)) / model.fit,
    )
    # (Beside a step holding the GIL, the stall is the GIL's: a deeper queue does not help.)
    jitter = model.step_cores < 0.5 and model.measured_s > 1.15 * unstalled
    if m.workers > 0 and m.prefetch < 4 and jitter:
        add(
            "prefetch_batches",
            {"prefetch_batches": 2 * m.prefetch},
            f"the loader keeps pace on average but the step still waits: {m.prefetch} batches "
            "ahead do not cover its uneven batches",
            unstalled,
        )
    need = model.cores_needed()
    if need > m.cores_per_rank:
        per_core = 1 / max(model.cpu_per_sample, 1e-12)
        add(
            "cores",
            {"cores": need, "num_workers": need},
            f"the loader decodes {per_core:,.0f} samples/s per core; {need} cores per GPU "
            "keep pace with the step",
            model.batch_s(Settings(need, need)),
            applicable=False,
        )
    if dali_rate:
        add(
            "dali",
            {"decode": "dali"},
            "decode on the GPU (DALI, nvJPEG): measured "
            f"{dali_rate:,.0f} samples/s from the warm cache",
            max(model.step, model.B / dali_rate),
        )
    found = [f for f in found if f.gain >= MIN_GAIN]
    found.sort(key=lambda f: (-f.gain, not f.applicable))
    if fetching or basis.name == "budget":  # then what binds once warm, and its fixes
        listed = {f.name for f in found}
        for f in fixes(m, model, m.train, usd_per_gpu_hour=usd_per_gpu_hour, warm_command=""):
            if f.name in listed:
                continue
            f.why = f"once warm: {f.why}"
            f.gain = round(now_s / (model.B / f.predicted_samples_per_s), 4)
            found.append(f)
    return found


def _cache_fixes(m: Measured, model: Model, advice: CacheAdvice, add: Any) -> None:
    """A budget of the share where the disk has room (the warm rate), and a policy that
    keeps what the budget holds (its hit rate's share of an all-miss epoch's fetching)."""
    assert m.budget is not None
    assert m.cache_budget is not None
    now_s = model.B / max(m.budget.samples_per_s, 1e-9)
    warm_s = model.measured_s
    hit_now = m.budget.hit_rate if m.budget.hit_rate is not None else 0.0
    # Misses are fetched ahead, overlapped: an epoch that misses a share of its objects
    # waits for that share of an all-miss epoch's fetching, or decodes at the warm rate.
    # The all-miss rate is a first epoch's (measured cold); without one, what the budget
    # epoch now took for the share it missed.
    cold = m.cold if m.cold is not None else m.first
    if cold is not None and cold.samples_per_s > 0:
        miss_s = model.B / cold.samples_per_s
    else:
        miss_s = now_s / max(1.0 - hit_now, 0.05)
    share = m.share_bytes
    if advice.max_bytes >= share:
        add(
            "max_bytes",
            {"max_bytes": share},
            f"the cache budget ({_size(m.cache_budget)}) holds {m.cache_budget / share:.0%} "
            f"of this node's share ({_size(share)}) and the disk has room for all of it: "
            "every epoch after the first then reads from the cache",
            warm_s,
            floor=False,  # the epochs after the first: the first epoch's fetching is past
        )
    for policy in ("pin", "plan"):
        if policy == m.budget_policy or (policy == "plan") != (advice.policy == "plan"):
            continue
        hit = hit_rate(policy, m.cache_budget, share)
        add(
            "policy",
            {"policy": policy},
            f"policy {m.budget_policy!r} read {hit_now:.0%} of the last epoch from the cache; "
            f"{policy!r} keeps what the budget holds: {hit:.0%} of each epoch",
            max(warm_s, (1 - hit) * miss_s),
            floor=False,
        )


def _size(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} B"


def _fix(
    name: str,
    change: dict[str, object],
    why: str,
    batch_s: float,
    now_s: float,
    model: Model,
    m: Measured,
    usd: float | None,
    *,
    command: str | None = None,
    applicable: bool = True,
) -> Fix:
    rate = model.B / batch_s
    epoch_s = m.dataset_samples / rate if rate > 0 else math.inf
    return Fix(
        name=name,
        change=change,
        why=why,
        predicted_samples_per_s=round(rate, 3),
        predicted_utilization=round(model.utilization(batch_s), 4),
        predicted_epoch_s=round(epoch_s, 3),
        predicted_epoch_usd=None if usd is None else round(epoch_s / 3600 * usd * m.gpus, 6),
        gain=round(now_s / batch_s, 4),
        command=command,
        applicable=applicable,
    )


def verdict(
    m: Measured,
    model: Model,
    basis: Phase,
    neck: str,
    *,
    usd_per_gpu_hour: float | None,
    epochs_per_day: float | None,
) -> Verdict:
    batch_s = current_s(m, model, basis)
    util = model.utilization(batch_s)
    rate = model.B / batch_s
    epoch_s = m.dataset_samples / rate if rate > 0 else math.inf
    epoch_usd = lost = per_day = None
    if usd_per_gpu_hour is not None:
        epoch_usd = epoch_s / 3600 * usd_per_gpu_hour * m.gpus
        lost = epoch_usd * (1 - util)
        per_day = (
            lost * epochs_per_day
            if epochs_per_day is not None
            else (1 - util) * usd_per_gpu_hour * m.gpus * 24
        )
    where = {
        "cold": "reading into an empty cache (a first epoch)",
        "budget": "in the epochs after the first, with the cache's budget below the share",
    }.get(basis.name, "reading from a warm cache")
    waits = {
        "none": "the step never waits: the GPU is the bottleneck",
        "fetch": "the step waits for the remote: the cache does not hold the data yet",
        "read": "the step waits for reading cached bytes",
        "decode": "the step waits for decoding (CPU)",
        "collate": "the step waits for collating batches",
        "gil": "the loader's threads take the GIL and cores from a step that holds the GIL",
        "h2d": "the step waits for the host to device copy",
    }[neck]
    once_warm = warm_bottleneck(m, model) if basis.name in ("cold", "budget") else None
    summary = f"{waits}, {where}"
    if once_warm is not None and once_warm != neck:
        summary += f" ({neck} now, {once_warm} once warm)"
    found = fetch_ratio(m, basis)
    if neck != "none" and found is not None and not decides(*found):
        summary += (
            f"; fetching may bind now too: the rate is {found[0]:.2f}x the fetch line, "
            f"within its noise (±{found[1]:.0%}), so the verdict is what binds once warm"
        )
    return Verdict(
        utilization=round(util, 4),
        samples_per_s=round(rate, 3),
        ceiling_samples_per_s=round(m.ceiling.samples_per_s, 3),
        epoch_s=round(epoch_s, 3),
        epoch_usd=None if epoch_usd is None else round(epoch_usd, 6),
        lost_usd_per_epoch=None if lost is None else round(lost, 6),
        lost_usd_per_day=None if per_day is None else round(per_day, 4),
        basis=basis.name,
        summary=summary,
        confidence=confidence(m, model, basis, neck),
        once_warm=once_warm,
    )
