"""Typed trees: nested mappings (YAML, ``--set`` overrides) into frozen dataclasses, with one-line errors.

:func:`build` checks every value against the dataclass field's type hint (ints, floats, strings, bools, tuples,
mappings, optionals, nested dataclasses) and reports the first problem as a :class:`ConfigError` naming the dotted key.
A dataclass's own ``__post_init__`` checks run as it is built; a ``ValueError`` from one becomes a ``ConfigError``.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration the user must fix: the message says what and how."""


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return build(hint, value, where)
    if hint is Any:
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args and args[-1] is Ellipsis else None
        if inner is None:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, got {value!r}")
            return tuple(_coerce(v, a, where) for v, a in zip(value, args))
        return tuple(_coerce(v, inner, where) for v in value)
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} fits none of {hint}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if hint is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {value!r}")
    raise ConfigError(f"{where}: unsupported type {hint}")


def build(cls, values: dict, where: str = ""):
    """``cls(**values)`` for a (frozen) dataclass ``cls``, every value checked against its type hint and nested
    dataclasses built from mappings; unknown keys, wrong types and the class's own checks are :class:`ConfigError`s."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; known keys here: {', '.join(sorted(names))}")
    values = dict(values)
    for f in dataclasses.fields(cls):  # a section whose default is an instance: the given keys update that instance
        if dataclasses.is_dataclass(f.default) and isinstance(values.get(f.name), dict):
            values[f.name] = {**{g.name: getattr(f.default, g.name) for g in dataclasses.fields(f.default)},
                              **values[f.name]}
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where or 'config'}: {err}") from None


def set_path(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted = "a.b.c"``, creating sections on the way."""
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=1e-3"`` → ``("train.lr", 0.001)``; the value is parsed as YAML (so lists and bools work)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: cannot parse {raw!r} ({err})") from None
    return key.strip(), value
