"""The `config.json` of a saved model: one layout, read by `TitansLM.from_pretrained` and by `titans.io.hf`.

    {"model_type": "titans", "titans_format_version": 4, "titans": {<every TitansConfig field>}}

`model_type` is what Hugging Face's `AutoConfig` dispatches on; the `titans` section is a `TitansConfig`,
loaded strictly (an unknown field is refused, so a typo never falls back to a default). Other top-level keys
are Hugging Face's bookkeeping (`transformers_version`, `architectures`, `dtype`, ...) and are left to it.

The format version says which fields a file may hold. A field added later raises the version, and its default
must be the behaviour of the files written before it: an older file, which lacks it, loads with the default, or,
where a default changed since, with the earlier one (`EARLIER_DEFAULTS`). A
file of a version newer than `FORMAT_VERSION` may hold fields (or meanings) this library does not know, so it
is refused with a message saying to upgrade, not half-read.

Versions: 1 wrote the memory's fields flat among the others (`memory_depth`, `chunk_size`, `max_lr`,
`memory_residual`, ...); 2 writes them in the `memory` section (`memory: {depth, chunk_size, max_lr, residual, loss,
...}`, `TitansConfig.memory`). A version-1 section is read by moving each flat field to its place in the section
(`models.config.FLAT_MEMORY_FIELDS`, the same reading every config gets), those it lacks whose default changed taking
their earlier value, and the loss, which version 1 did not have, the squared one (the only loss then). 3 adds MAC's
switches (`mac_write_input`, `mac_residual_read`, `mac_position_free_persistent`, `mac_separate_norms`) and the
`titans_pytorch` options of the peer variant: a version-2 file lacks them and loads with the switches off, the model
it was saved from (the default then; all four are on since issue 47, `EARLIER_DEFAULTS`). 4 writes the attention's
fields (`window`, `segment_len`, `n_persistent`, `rope_base`) in the `attention` section (`TitansConfig.attention`);
every earlier version wrote them flat, and they are read into the section as the memory's are
(`models.config.FLAT_ATTENTION_FIELDS`).
"""

from __future__ import annotations

from typing import Any

from ..models.config import TitansConfig, with_earlier_defaults

MODEL_TYPE = "titans"
FORMAT_VERSION = 4  # raise it with every TitansConfig field added (see the module docstring)
SECTION = "titans"
VERSION_KEY = "titans_format_version"


def config_to_saved(config: TitansConfig) -> dict[str, Any]:
    """The config.json of a model: every field written, so a later change of a default cannot change the model."""
    return {"model_type": MODEL_TYPE, VERSION_KEY: FORMAT_VERSION, SECTION: config.to_dict()}


def check_format_version(version: Any, source: str) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{source}: {VERSION_KEY} must be an integer >= 1, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{source} was written in titans format version {version}, newer than this library reads "
                         f"({FORMAT_VERSION}); upgrade titans to load it")
    return version


def section_to_config(section: Any, version: Any, source: str) -> TitansConfig:
    """The TitansConfig of a `titans` section written in format `version` (fields it lacks take their defaults)."""
    check_format_version(version, source)
    if not isinstance(section, dict):
        raise ValueError(f"{source}: '{SECTION}' must be a mapping of TitansConfig fields, "
                         f"got {type(section).__name__}")
    try:
        return TitansConfig.from_dict(section)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def saved_to_config(data: Any, source: str) -> TitansConfig:
    """The TitansConfig of a config.json's contents; `source` names the file in errors.

    A file without `model_type` is the flat layout written before this one (the TitansConfig fields at the top).
    """
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(data).__name__}")
    if "model_type" not in data and SECTION not in data:
        return section_to_config(with_earlier_defaults(data), 1, source)  # the flat layout of the first saved models
    if data.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{source} is not a titans model: model_type is {data.get('model_type')!r}, "
                         f"not {MODEL_TYPE!r}")
    if VERSION_KEY not in data or SECTION not in data:
        missing = [key for key in (VERSION_KEY, SECTION) if key not in data]
        raise ValueError(f"{source} lacks {' and '.join(missing)}")
    section = data[SECTION]
    return section_to_config(with_earlier_defaults(section) if isinstance(section, dict) else section,
                             data[VERSION_KEY], source)
