"""`OffloadConfig` refuses a value of the wrong type instead of coercing it, at every level of the model.

Lax coercion would read `cpu_blocks=True` as a pool of one block and `layer_loads="yes"` as on; each rule below
is one refusal, with the legitimate inputs (an int for a float, a JSON-shaped list of tiers, a path as a string)
still accepted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest

from kvfsm.config import DiskTierConfig, MooncakeTierConfig, OffloadConfig

MOONCAKE = {"kind": "mooncake", "master": "host:5000", "model_id": "m", "kv_dtype": "bfloat16"}


@pytest.mark.parametrize("field", ["cpu_blocks", "block_size_factor", "gpu_block_size", "num_workers"])
def test_a_bool_for_an_int_field_is_refused(field: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        OffloadConfig(**{"cpu_blocks": 8, field: True})


@pytest.mark.parametrize("field", ["layer_loads", "layer_stores", "checksum", "kv_events"])
def test_a_string_or_an_int_for_a_bool_field_is_refused(field: str) -> None:
    for value in ("yes", "true", 1):
        with pytest.raises(pydantic.ValidationError, match=field):
            OffloadConfig(cpu_blocks=8, **{field: value})


def test_a_numeric_string_or_a_whole_float_for_an_int_field_is_refused() -> None:
    for value in ("8", 8.0):
        with pytest.raises(pydantic.ValidationError, match="cpu_blocks"):
            OffloadConfig(cpu_blocks=value)


def test_an_int_where_a_float_is_expected_is_accepted() -> None:
    tier = MooncakeTierConfig(**(MOONCAKE | {"op_timeout_s": 3}))
    assert tier.op_timeout_s == 3.0 and isinstance(tier.op_timeout_s, float)


def test_a_bool_or_a_string_where_a_float_is_expected_is_refused() -> None:
    for value in (True, "3"):
        with pytest.raises(pydantic.ValidationError, match="io_timeout_s"):
            DiskTierConfig(path=Path("/tmp"), capacity_bytes=1 << 20, io_timeout_s=value)


def test_a_lower_tier_given_as_a_dict_is_as_strict_as_the_top_level() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_pending"):
        OffloadConfig(cpu_blocks=8, lower_tiers=[MOONCAKE | {"max_pending": True}])


def test_a_lower_tier_named_like_the_cpu_pool_is_refused(tmp_path: Path) -> None:
    """Its hits and events would pass for the CPU pool's."""
    with pytest.raises(pydantic.ValidationError, match="may not be named 'cpu'"):
        OffloadConfig(cpu_blocks=8, lower_tiers=[{"kind": "disk", "name": "cpu", "path": str(tmp_path),
                                                  "capacity_bytes": 1 << 20}])


def test_a_config_read_from_json_is_accepted_with_a_list_of_tiers_and_a_string_path(tmp_path: Path) -> None:
    """What vLLM's `kv_connector_extra_config` holds: JSON types, tiers as a list, a path as a string."""
    extra: dict[str, Any] = json.loads(json.dumps({
        "cpu_bytes": 1 << 30, "block_size_factor": 2, "eviction": "arc", "layer_stores": True, "kv_events": True,
        "lower_tiers": [MOONCAKE | {"op_timeout_s": 5}, {"kind": "disk", "path": str(tmp_path),
                                                          "capacity_bytes": 1 << 20}],
    }))
    config = OffloadConfig(**extra)
    assert config.lower_tiers[0].op_timeout_s == 5.0
    assert config.lower_tiers[1].path == tmp_path and config.kv_events


def test_a_path_that_is_neither_a_string_nor_a_path_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="path"):
        DiskTierConfig(path=3, capacity_bytes=1 << 20)


def test_the_configuration_page_lists_every_field_and_no_other() -> None:
    """docs/configuration.md's table is the user's reference: a field added to the model must appear there."""
    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", page, flags=re.MULTILINE)
    assert sorted(listed) == sorted(OffloadConfig.model_fields)
