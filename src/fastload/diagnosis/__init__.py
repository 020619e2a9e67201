"""``fastload doctor`` / ``fl.doctor``: where a training step waits for data, what it costs,
and the setting that fixes it (with ``apply``, measured against its prediction).

``measure`` runs the phases, ``predict`` turns them into a verdict and ranked fixes,
``report`` holds the result (its JSON schema), ``render`` prints and draws it, ``prices``
puts money on a GPU-hour, ``steps`` and ``models`` are the training steps it times.
"""

from fastload.diagnosis.diagnose import DoctorError, doctor
from fastload.diagnosis.report import Applied, Fix, Phase, Report, Verdict

__all__ = ["Applied", "DoctorError", "Fix", "Phase", "Report", "Verdict", "doctor"]
