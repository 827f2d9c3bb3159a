"""Config values checked into typed settings before anything is generated, each error naming its key.

Hydra hands the decode CLI untyped values: ``decode.cfg_scale=abc``, a method
setting misspelt in a preset, ``rounds=-1`` or ``delta=nan`` would otherwise
surface mid-run as a TypeError naming nothing, or not at all. `settings_from`
builds a frozen settings dataclass from such values: unknown keys, wrong types
and non-finite numbers are refused with the full key, and the dataclass's own
``__post_init__`` checks ranges.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Literal


def settings_from(cls: type, values: Mapping[str, Any], where: str):
    """An instance of the dataclass `cls` from `values`; `where` is the config path they came from (for errors)."""
    hints = typing.get_type_hints(cls)
    known = [field.name for field in fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"{where}: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"the settings are {', '.join(known) or 'none'}"
        )
    checked = {key: checked_value(value, hints[key], f"{where}.{key}") for key, value in values.items()}
    try:
        return cls(**checked)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def checked_value(value: Any, hint: Any, key: str) -> Any:
    """`value` if it fits the type `hint` (bool, int, float, str, a Literal, or a union with None), else an error."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [arg for arg in args if arg is not type(None)]
        return checked_value(value, inner[0], key) if len(inner) == 1 else value
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    return value
