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
from .sensitivity import SensitivityReport, auto_keep, choose_keeps, parse_budget, scan_sensitivity

__all__ = [
    "CalibrationDataError",
    "CalibrationOptions",
    "CalibrationSet",
    "DatasetDefinition",
    "SensitivityReport",
    "auto_keep",
    "build_calibration_set",
    "builtin_corpus",
    "calibration_dirs",
    "choose_keeps",
    "fingerprint",
    "load_definitions",
    "model_info",
    "parse_budget",
    "resolve_dataset",
    "scan_sensitivity",
]
