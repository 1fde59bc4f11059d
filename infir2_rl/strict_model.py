"""The pydantic base of every config class (``config/``'s sections and stages, ``algo``'s ``AlgorithmConfig``).

One place for what every config shares: an unknown key is an error (``extra="forbid"``), assignments are
validated, every float is finite, and a number is never taken from a boolean. Pydantic's lax mode reads
``True``/``False`` as 1/0 for an ``int`` or ``float`` field, so ``optimizer.lr=true`` on the command line (or
``lr: yes`` in YAML, which YAML reads as a boolean) would train at a learning rate of 1.0 without a word.
``StrictModel`` refuses a boolean in every field whose type takes a number (``float``, ``int``, ``int | None``,
``X | Literal[...]``, the items of ``tuple[float, float]`` and ``list[int]``), unless the type also takes a
boolean (``bool | Literal["auto"]``). Integers stay numbers for float fields (``lr: 1``).

This module imports nothing of the package, so ``algo/`` uses it without importing ``config/``.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

# The error type of a boolean given for a number (config/loader.py prefixes the message with the section).
BOOL_NOT_NUMBER = "bool_not_number"


def _alternatives(tp: Any) -> tuple[Any, ...]:
    """The types a value of ``tp`` may be: the members of a union (``X | None``), ``Annotated`` unwrapped."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _alternatives(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return tuple(alt for arg in get_args(tp) for alt in _alternatives(arg))
    return (tp,)


def _takes_bool(tp: Any) -> bool:
    return tp is bool or (get_origin(tp) is Literal and any(isinstance(v, bool) for v in get_args(tp)))


def _item_type(tp: Any, index: int) -> Any:
    """The type of item ``index`` of a ``list[X]`` / ``tuple[X, Y]`` / ``tuple[X, ...]`` type; None otherwise."""
    origin, args = get_origin(tp), get_args(tp)
    if not args:
        return None
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        return args[index] if index < len(args) else None
    if origin in (list, set, frozenset, Sequence):
        return args[0]
    return None


def bool_for_number(value: Any, tp: Any) -> tuple[str, bool] | None:
    """The boolean in ``value`` that a field of type ``tp`` would read as a number, with where it is (``""``:
    the value itself, ``"[1]"``: an item of a list or tuple); None when there is none."""
    alternatives = _alternatives(tp)
    if isinstance(value, bool):
        if any(_takes_bool(alt) for alt in alternatives):
            return None
        return ("", value) if any(alt in (int, float) for alt in alternatives) else None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            for alt in alternatives:
                item_tp = _item_type(alt, i)
                if item_tp is not None and (found := bool_for_number(item, item_tp)) is not None:
                    return f"[{i}]{found[0]}", found[1]
    return None


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        # Runs on construction and on every assignment (pydantic passes the whole field dict then). Nested
        # configs check their own fields; the loader prefixes the section (config/loader.py).
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            if name in data and (found := bool_for_number(data[name], field.annotation)) is not None:
                where, value = found
                raise PydanticCustomError(
                    BOOL_NOT_NUMBER,
                    "{key}={value}: must be a number, not a boolean (YAML reads true/false, yes/no and on/off"
                    " as booleans); write the number",
                    {"key": name + where, "value": str(value).lower()},
                )
        return data
