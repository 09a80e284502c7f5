"""The quantize job, resolved once (k3convert.pipeline.QuantizeJob): a recipe's sections
are the defaults, explicit options win, and the checks hold whichever way it is built."""

from __future__ import annotations

import pytest

from k3convert.calibrate.sequential import SequentialOptions
from k3convert.errors import ConfigError
from k3convert.pipeline import QuantizeJob, prepare_quantization

RECIPE = """\
quantize:
  scheme: w8a8
  keep: ["re:.*lm_head.*"]
  calibrate: {algorithm: smoothquant, alpha: 0.8, num_samples: 4}
  auto_keep: {budget: 5%, sensitivity: output}
"""


def test_recipe_sections_are_the_defaults(tmp_path):
    rp = tmp_path / "r.yaml"
    rp.write_text(RECIPE)
    job = QuantizeJob.resolve(recipe=rp)
    assert job.recipe is not None and job.scheme is None
    assert job.algorithm == "smoothquant" and job.calibrate.alpha == 0.8
    assert job.calibrate.num_samples == 4
    assert (job.auto_keep, job.sensitivity) == ("5%", "output")
    assert job.keep == ()  # the recipe's own keeps stay in its rules (planning adds them)


def test_explicit_options_win_over_the_recipe(tmp_path):
    rp = tmp_path / "r.yaml"
    rp.write_text(RECIPE)
    mine = SequentialOptions(num_samples=2)
    job = QuantizeJob.resolve(recipe=rp, calibrate=mine, algorithm="gptq", auto_keep="1GB",
                              keep=["a", "b"])  # fmt: skip
    assert job.calibrate is mine and job.algorithm == "gptq"
    assert job.auto_keep == "1GB" and job.sensitivity == "layer"  # the section is replaced
    assert job.keep == ("a", "b")


def test_exactly_one_of_scheme_and_recipe(tmp_path):
    rp = tmp_path / "r.yaml"
    rp.write_text(RECIPE)
    for kw in ({}, {"scheme": "w8a8", "recipe": rp}):
        with pytest.raises(ConfigError, match="exactly one of --scheme"):
            QuantizeJob.resolve(**kw)


def test_a_job_or_its_options(tmp_path):
    job = QuantizeJob.resolve(scheme="w8a8")
    with pytest.raises(TypeError, match="not both"):
        prepare_quantization(src=tmp_path, job=job, scheme="w8a8")
