"""Calibration for quantization: the calibration-data layer (``data.py``).

``build_calibration_set(model_dir, dataset, ...)`` gives a :class:`CalibrationSet` of
token blocks with a fingerprint; ``builtin_corpus()`` the default texts.
"""

from __future__ import annotations

from .data import (
    CalibrationDataError,
    CalibrationOptions,
    CalibrationSet,
    DatasetDefinition,
    build_calibration_set,
    builtin_corpus,
    calibration_dirs,
    fingerprint,
    load_definitions,
    model_info,
    resolve_dataset,
)

__all__ = [
    "CalibrationDataError",
    "CalibrationOptions",
    "CalibrationSet",
    "DatasetDefinition",
    "build_calibration_set",
    "builtin_corpus",
    "calibration_dirs",
    "fingerprint",
    "load_definitions",
    "model_info",
    "resolve_dataset",
]
