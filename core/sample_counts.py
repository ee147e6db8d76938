"""How many samples Kiln's statistics need before it trusts them without a warning."""

from __future__ import annotations

# Fewer rows than this are warned of, wherever a decision rests on them: the calibration rows whose ranges set
# INT8/FP8 scales (the precision stage, ``kiln precision``), and the rows an engine is validated on (``kiln validate
# --inputs``, the held-out rows of a run). One calibration batch at the default calibration.batch_size.
FEW_ROWS = 32
