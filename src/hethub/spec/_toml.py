"""Small helpers to read validated values out of parsed TOML/JSON tables.

Each helper names the file and the field in its error, so that a typo in a cluster file is answered
with "cluster.toml: field 'kinds.a100.mem_gib' must be a positive number", not a KeyError.
"""

import tomllib
from pathlib import Path
from typing import Any

from hethub.errors import HethubError, SpecError, field_error


def read_toml(path: str | Path, *, what: str, cls: type[HethubError] = SpecError) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise cls(f"{what} file '{p}' does not exist. Fix: pass the path of an existing TOML file.")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise cls(f"{p}: not valid TOML ({err}). Fix: correct the syntax at that line.") from None
    except UnicodeDecodeError:
        raise cls(f"{p}: not UTF-8 text. Fix: save the {what} file as UTF-8 TOML.") from None


def check_keys(table: dict[str, Any], *, allowed: set[str], where: str, cls: type[HethubError] = SpecError):
    if not isinstance(table, dict):
        raise cls(f"{where}: expected a table, got {type(table).__name__}. Fix: write it as a TOML table.")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise field_error(
            where, unknown[0], "is not a known field",
            f"remove it or use one of: {', '.join(sorted(allowed))}", cls=cls,
        )


def get_number(
    table: dict[str, Any], key: str, *, where: str, default: float | None = None,
    positive: bool = True, cls: type[HethubError] = SpecError,
) -> float:
    if key not in table:
        if default is None:
            raise field_error(where, key, "is missing", f"add {key} = <number>", cls=cls)
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise field_error(where, key, f"must be a number, got {value!r}", f"write {key} = <number>", cls=cls)
    if value != value or value in (float("inf"), float("-inf")):
        raise field_error(where, key, "must be finite", "give a finite number", cls=cls)
    if positive and value <= 0:
        raise field_error(where, key, f"must be > 0, got {value}", "give a positive number", cls=cls)
    if not positive and value < 0:
        raise field_error(where, key, f"must be >= 0, got {value}", "give a non-negative number", cls=cls)
    return float(value)


def get_int(
    table: dict[str, Any], key: str, *, where: str, default: int | None = None, minimum: int = 1,
    cls: type[HethubError] = SpecError,
) -> int:
    if key not in table:
        if default is None:
            raise field_error(where, key, "is missing", f"add {key} = <integer>", cls=cls)
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise field_error(where, key, f"must be an integer, got {value!r}", f"write {key} = <integer>", cls=cls)
    if value < minimum:
        raise field_error(where, key, f"must be >= {minimum}, got {value}", f"use at least {minimum}", cls=cls)
    return value


def get_str(
    table: dict[str, Any], key: str, *, where: str, default: str | None = None,
    choices: tuple[str, ...] | None = None, cls: type[HethubError] = SpecError,
) -> str:
    if key not in table:
        if default is None:
            raise field_error(where, key, "is missing", f'add {key} = "<text>"', cls=cls)
        return default
    value = table[key]
    if not isinstance(value, str) or not value:
        raise field_error(where, key, f"must be a non-empty string, got {value!r}", f'write {key} = "<text>"',
                          cls=cls)
    if choices is not None and value not in choices:
        raise field_error(where, key, f"must be one of {', '.join(choices)}, got {value!r}",
                          f"use one of {', '.join(choices)}", cls=cls)
    return value


def get_bool(table: dict[str, Any], key: str, *, where: str, default: bool,
             cls: type[HethubError] = SpecError) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise field_error(where, key, f"must be true or false, got {value!r}", f"write {key} = true", cls=cls)
    return value
