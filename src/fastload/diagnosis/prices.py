"""GPU prices per GPU-hour, the defaults ``fastload doctor`` puts money on.

The figures are on-demand list prices as the project's founding guide quotes them (an
8xA100 80GB node at about $12,000 a month is ~$2.05 per GPU-hour; an H100 SXM at about
$250 a GPU-day is ~$10.4; a T4 at about $0.35), and the cloud providers' single-GPU
instances for the rest. They are defaults: ``--price`` replaces them, and a name not in
the table needs one. ``--spot`` takes the discount Spot capacity gives (up to 65%).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastload.errors import FastloadError

# name -> (USD per GPU-hour, where the figure comes from)
GPU_PRICES: dict[str, tuple[float, str]] = {
    "H100": (250.0 / 24, "H100 SXM at about $250 a GPU-day"),
    "A100": (12_000.0 / (730 * 8), "8xA100 80GB node at about $12,000 a month"),
    "A10": (1.006, "AWS g5.xlarge (one A10G) on demand"),
    "L4": (0.805, "AWS g6.xlarge (one L4) on demand"),
    "V100": (3.06, "AWS p3.2xlarge (one V100) on demand"),
    "T4": (0.35, "T4 at about $0.35 an hour on demand"),
}
SPOT_DISCOUNT = 0.65  # "Spot instances saving up to 65%"


class UnknownGPUError(FastloadError, ValueError):
    """A GPU name without a built-in price, and no --price given."""


@dataclass(frozen=True)
class Price:
    gpu: str | None
    usd_per_gpu_hour: float | None  # after the Spot discount; None: no price known
    spot: bool
    spot_discount: float
    source: str

    def to_dict(self) -> dict[str, object]:
        return {
            "gpu": self.gpu,
            "usd_per_gpu_hour": None
            if self.usd_per_gpu_hour is None
            else round(self.usd_per_gpu_hour, 4),
            "spot": self.spot,
            "spot_discount": self.spot_discount if self.spot else 0.0,
            "source": self.source,
        }


def canonical(name: str) -> str | None:
    """The table's name for ``name`` ("a100-80gb", "NVIDIA H100 80GB HBM3", "A10G" -> A100,
    H100, A10), or None."""
    words = name.upper().replace("-", " ").replace("_", " ").split()
    for gpu in sorted(GPU_PRICES, key=len, reverse=True):  # A100 before A10
        if any(word in (gpu, gpu + "G") for word in words):
            return gpu
    return None


def price_for(
    gpu: str | None,
    usd_per_hour: float | None = None,
    *,
    spot: bool = False,
    spot_discount: float = SPOT_DISCOUNT,
) -> Price:
    """The hourly price to put on a GPU: ``usd_per_hour`` if given (the on-demand figure:
    ``spot`` discounts it too), else the table's for ``gpu``. No GPU and no price: None."""
    if not 0 <= spot_discount < 1:
        raise ValueError(f"the Spot discount must be within [0, 1), got {spot_discount}")
    if usd_per_hour is not None and usd_per_hour < 0:
        raise ValueError(f"the price must be >= 0 USD an hour, got {usd_per_hour}")
    factor = 1 - spot_discount if spot else 1.0
    spot_note = f", Spot at {spot_discount:.0%} off" if spot else ""
    if usd_per_hour is not None:
        return Price(gpu, usd_per_hour * factor, spot, spot_discount, f"given{spot_note}")
    if gpu is None:
        return Price(None, None, spot, spot_discount, "no GPU named: pass --gpu or --price")
    known = canonical(gpu)
    if known is None:
        raise UnknownGPUError(
            f"no built-in price for GPU {gpu!r} (known: {', '.join(GPU_PRICES)}): "
            "give its price with --price USD_PER_GPU_HOUR"
        )
    hourly, source = GPU_PRICES[known]
    return Price(known, hourly * factor, spot, spot_discount, source + spot_note)
