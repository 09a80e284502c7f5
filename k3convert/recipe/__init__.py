"""Recipe files: YAML parsed with ``yaml.safe_load`` into frozen dataclasses.

A recipe says what a conversion does, end to end, so it is validated completely before
anything runs: unknown keys are an error naming the key path (``quantize.rules[1].sheme``)
and the nearest valid key, values are type-checked, scheme names and their options are
resolved against the registry, patterns are compiled, files it names must exist, and
impossible layouts (``moe_tp * moe_ep != tp``) are refused. Schema version 1::

    version: 1                      # optional; the only version so far
    description: Kimi-K2 with int4 routed experts
    source: {path: /models/kimi-k2, model_type: kimi_k2}   # both optional
    quantize:                       # optional: without it tensors stay as released
      rules:
        - roles: [experts]
          scheme: w4a16
          options: {group_size: 32}
        - roles: [attention]
          scheme: fp8-block
      keep: ["re:.*layers\\.0\\..*"]   # optional extra keeps
      default_keep: true                # architecture default exceptions
      calibrate:                        # optional: every --calibrate option
        algorithm: gptq
        dataset: default
        num_samples: 256
        kv_cache: fp8
      auto_keep: {budget: 5%, scheme: int8-g128}   # optional: --auto-keep
    layout: {tp: 8, pp: 1, moe_ep: 8, redundant_experts: 32, expert_load: calibration}
    output: {compression: zstd, workers: 8, unit_hash: xxh3-128}
    verify: {samples: 2, seq_len: 64, decode: 4, max_kld: 0.05}

A quantize-only recipe of the first format (``description`` + ``quantize``) is a valid
version-1 recipe. A ``calibrate`` / ``auto_keep`` section applies when the command line
(or the API call) gives no ``--calibrate`` / ``--auto-keep`` of its own; one that does
replaces the recipe's section as a whole. Tensors matched by no rule are kept unless
``quantize.scheme`` names a default.

Relative paths in a recipe file (``source.path``, ``layout.expert_load``, ``verify.data``,
``verify.reference``, ``verify.pixel_values``, a ``calibrate.dataset`` that is a path)
are taken from the recipe file's directory, so a recipe and its data move together.
Overrides (``--set layout.tp=8``, :func:`~.yaml_io.apply_overrides`) are applied to the YAML
document before validation, so a bad override fails like a bad recipe, with its key path.

Reading is defensive (``yaml.safe_load`` semantics through a SafeLoader subclass): a
recipe must be UTF-8 and at most :data:`~.yaml_io.MAX_RECIPE_BYTES`; nesting deeper than
:data:`~.yaml_io.MAX_DEPTH` levels and documents that expand (aliases repeating their anchors) to
more than :data:`~.yaml_io.MAX_NODES` nodes are refused while composing, before anything is
expanded (billion-laughs bombs); duplicate keys are an error naming the key and its
lines. Messages quote a bad value as its type and a short prefix (:func:`short_repr`),
never the whole value.

The package: :mod:`.sections` (the schema's dataclasses), :mod:`.yaml_io` (bounded YAML
reading, overrides), :mod:`.build` (typed building with key paths), :mod:`.checks`
(validation, shared with ``quantize``'s flags), :mod:`.parse` (files, presets, dumping).
"""

from .checks import auto_keep_section, calibrate_section
from .parse import (
    ENV_RECIPES,
    dump_recipe,
    load_recipe,
    parse_recipe,
    preset_path,
    preset_summary,
    presets,
    recipe_dirs,
    recipe_to_dict,
)
from .sections import (
    CALIBRATION,
    VERSIONS,
    AutoKeepSection,
    CalibrateSection,
    LayoutSection,
    OutputSection,
    QuantizeSection,
    Recipe,
    RuleSpec,
    SourceSection,
    TargetSection,
    VerifySection,
)
from .yaml_io import (
    MAX_DEPTH,
    MAX_NODES,
    MAX_RECIPE_BYTES,
    PATH_KEYS,
    apply_overrides,
    read_recipe_text,
)

__all__ = [
    "CALIBRATION", "ENV_RECIPES", "MAX_DEPTH", "MAX_NODES", "MAX_RECIPE_BYTES", "PATH_KEYS",
    "VERSIONS", "AutoKeepSection", "CalibrateSection", "LayoutSection", "OutputSection",
    "QuantizeSection", "Recipe", "RuleSpec", "SourceSection", "TargetSection",
    "VerifySection", "apply_overrides", "auto_keep_section", "calibrate_section",
    "dump_recipe", "load_recipe", "parse_recipe", "preset_path", "preset_summary",
    "presets", "read_recipe_text", "recipe_dirs", "recipe_to_dict",
]  # fmt: skip
