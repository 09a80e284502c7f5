"""The commands' pipelines, on top of every other layer: a job resolved once (recipe,
options, plan), then its stages run in order. :mod:`.quantize` is ``k3convert quantize``;
:mod:`.convert` (``k3convert convert``) composes the same preparation with shard and
verify, streaming from a :class:`~.planned.PlannedCheckpoint`; :mod:`.convert_report`
writes its report."""

from .quantize import (
    Prepared,
    QuantizeJob,
    QuantizeResult,
    UncalibratedInputWarning,
    plan_quantization,
    prepare_quantization,
    quantize,
)

__all__ = [
    "Prepared",
    "QuantizeJob",
    "QuantizeResult",
    "UncalibratedInputWarning",
    "plan_quantization",
    "prepare_quantization",
    "quantize",
]
