"""How a config key is declared, once: `key(...)` on a dataclass field, and the one parser that reads them all.

A field's `key(...)` says everything about its key: the check and its bounds, DeepSpeed 0.19.8's default (`ds`),
the value the Hugging Face Trainer writes for "auto" (`fill`), DeepSpeed's other spellings (`aliases`), and, for
a DeepSpeed key zeroedu does not implement, what happens to it: accepted with a `note` (it changes nothing here),
accepted at one value `only`, or refused with the reason (`refuse`) unless switched `off`. `parse` walks a
section's fields, so a key exists in exactly one place: there is no list of known keys beside the fields, no
default repeated in the parser, no separate table of notes.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Callable
from typing import Any


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()   # a Key field not given (None is a value: DeepSpeed's default may be null)
SKIP: Any = object()   # a value that did not pass: the field keeps its default (the problem is recorded)


class ConfigError(ValueError):
    """A config problem, with the key that caused it and what would fix it."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key. Exactly one of check / note / only / refuse / section says what zeroedu does with it."""

    check: Callable[[Any, str], Any] | None = None   # (value, full name) -> the value kept; raises ConfigError
    ds: Any = MISSING            # DeepSpeed 0.19.8's default where DeepSpeed has the key (tests compare them)
    differs: str = ""            # why zeroedu's default differs from DeepSpeed's, where it does
    fill: str | None = None      # what the Hugging Face Trainer writes in place of "auto"
    aliases: tuple[str, ...] = ()   # DeepSpeed's other names for the key (its pydantic field name or alias)
    note: str | None = None      # accepted; this is said when the key is given (and note_if(value) holds)
    note_if: Callable[[Any], bool] | None = None
    only: Any = MISSING          # accepted at this value only (DeepSpeed's default); `why` says why
    why: str = ""
    refuse: str | None = None    # refused with this reason, unless off(value): the feature switched off
    off: Callable[[Any], bool] | None = None
    section: type | None = None  # a nested section (a dataclass of keys)
    parser: Callable | None = None   # a section read by its own function (optimizer, scheduler)
    for_types: tuple[str, ...] = ()  # optimizer.params: the optimizer types that take the key
    knob: str = ""               # `zeroedu` section: "module:ATTRIBUTE", the module-level knob it sets


def key(default: Any = None, check=None, **spec) -> Any:
    """A dataclass field that is a config key; `spec` are Key's fields."""
    k = Key(check=check, **spec)
    if k.section is not None:
        return dataclasses.field(default_factory=default or k.section, metadata={"key": k})
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"key": k})
    return dataclasses.field(default=default, metadata={"key": k})


def keys_of(cls: type) -> dict[str, tuple[dataclasses.Field, Key]]:
    """Every spelling of every key of section `cls`: name -> (field, Key)."""
    out: dict[str, tuple[dataclasses.Field, Key]] = {}
    for f in dataclasses.fields(cls):
        k = f.metadata.get("key")
        if k is not None:
            for name in (f.name, *k.aliases):
                out[name] = (f, k)
    return out


def where(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


class Problems:
    """Everything wrong with a config, collected so that one error reports all of it; the notes; the keys given."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.given: set[str] = set()   # full names of the keys read without a problem

    def raise_if_any(self) -> None:
        if len(self.errors) == 1:
            raise ConfigError(self.errors[0])
        if self.errors:
            listed = "\n".join(f"  {i}. {e}" for i, e in enumerate(self.errors, 1))
            raise ConfigError(f"{len(self.errors)} problems in this config, each with its fix:\n{listed}")


def auto_problem(name: str, fill: str | None = None) -> str:
    return (f"'{name}' is \"auto\": a placeholder that the Hugging Face Trainer replaces before DeepSpeed reads "
            f"the config. Outside the Trainer, write the value yourself (the Trainer would write "
            f"{fill or 'the value you mean'}).")


def parse(cls: type, raw: Any, section: str, p: Problems) -> Any:
    """Section `cls` read from `raw`, every problem recorded in `p`. Sections that DeepSpeed parses with its
    pydantic models (cls.AUTO_IS_DEFAULT) read "auto" as the key left out, as DeepSpeedConfigModel.__init__ drops
    it (deepspeed/runtime/config_utils.py); elsewhere "auto" is the Trainer's placeholder and an error."""
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        p.errors.append(f"'{section}' must be a JSON object (a dict), got {type(raw).__name__} {raw!r}.")
        return cls()
    spellings = keys_of(cls)
    kw: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for name, value in raw.items():
        if not isinstance(name, str):
            p.errors.append(f"'{section or 'the config'}' has the key {name!r}, a {type(name).__name__}: config "
                            f"keys are strings (JSON's are); write \"{name}\".")
            continue
        full = where(section, name)
        if name not in spellings:
            unknown(cls, section, name, p)
            continue
        f, k = spellings[name]
        if f.name in seen:
            p.errors.append(f"'{full}' and '{where(section, seen[f.name])}' are two names of one DeepSpeed key: "
                            f"keep one.")
            continue
        seen[f.name] = name
        out = read(k, value, full, p, getattr(cls, "AUTO_IS_DEFAULT", False), getattr(cls, "AUTO_FILL", None))
        if out is not SKIP:
            kw[f.name] = out
            p.given.add(where(section, f.name))
    return cls(**kw)


def unknown(cls: type, section: str, name: str, p: Problems) -> None:
    names = sorted(n for n, (_, k) in keys_of(cls).items() if k.refuse is None and k.only is MISSING)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f" Did you mean '{where(section, close[0])}'?" if close else ""
    if not section:
        # DeepSpeed reads the top level key by key and never looks at the rest (deepspeed/runtime/config.py): a
        # key it does not know is ignored there, so here too, but said.
        p.notes.append(f"'{name}' is not a key DeepSpeed reads: ignored, as DeepSpeed ignores unknown top-level "
                       f"keys.{hint}")
        return
    p.errors.append(f"unknown config key '{where(section, name)}'.{hint} Valid keys here: {', '.join(names)}.")


def read(k: Key, value: Any, full: str, p: Problems, auto_is_default: bool, fill: str | None = None) -> Any:
    if isinstance(value, str) and value == "auto":
        if auto_is_default and k.refuse is None:
            said = "" if k.ds is MISSING else f" ({json.dumps(k.ds)} in DeepSpeed)"
            p.notes.append(f"'{full}' is \"auto\": DeepSpeed reads it as the key left out, its default{said}; so "
                           f"does zeroedu.")
            return SKIP
        fill = k.fill or fill or (f"{json.dumps(k.only)}, DeepSpeed's default, the one value zeroedu takes here"
                          if k.only is not MISSING else None)
        p.errors.append(auto_problem(full, fill))
        return SKIP
    if k.parser is not None:
        return k.parser(p, value, full)
    if k.section is not None:
        return parse(k.section, value, full, p)
    if k.refuse is not None:
        if value is None or (k.off or _enabled_false)(value):
            return value
        p.errors.append(f"'{full}' is a real DeepSpeed setting that zeroedu does not implement: {k.refuse}. "
                        f"Remove it to run here.")
        return SKIP
    if k.only is not MISSING:
        if value == k.only and type(value) is type(k.only):
            return value
        p.errors.append(f"'{full}' is a real DeepSpeed setting that zeroedu does not implement other than at its "
                        f"default {json.dumps(k.only)}: {k.why}. Remove it or set it to {json.dumps(k.only)}.")
        return SKIP
    if k.check is not None:
        try:
            value = k.check(value, full)
        except ConfigError as e:
            p.errors.append(str(e))
            return SKIP
    if k.note is not None and (k.note_if is None or k.note_if(value)):
        p.notes.append(k.note.format(where=full.rsplit(".", 1)[0]))
    return value


def _enabled_false(value: Any) -> bool:
    return isinstance(value, dict) and value.get("enabled") is False


# ---- checks: each returns the value to keep, or raises ConfigError naming the key, the problem and the fix ----

def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"'{name}' must be true or false, got {value!r}.")
    return value


def integer(lo: int, hi: int | None = None, null: bool = False, why: str = "") -> Callable[[Any, str], Any]:
    """A whole number in [lo, hi]; floats that are whole numbers (5e8, as DeepSpeed configs write sizes) pass.
    null: JSON null is allowed and means the key left out."""
    def check(value: Any, name: str) -> int | None:
        if value is None and null:
            return None
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"'{name}' must be an integer, got {value!r}.")
        if value < lo or (hi is not None and value > hi):
            rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"'{name}' must be {rng}, got {value}.{why and ' ' + why}")
        return value
    check.bounds = (lo, hi)   # type: ignore[attr-defined]
    return check


def number(lo: float, hi: float | None = None, why: str = "") -> Callable[[Any, str], float]:
    def check(value: Any, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"'{name}' must be a number, got {value!r}.")
        if value < lo:
            raise ConfigError(f"'{name}' must be >= {lo}, got {value}.")
        if hi is not None and value > hi:
            raise ConfigError(f"'{name}' must be at most {hi:g}, got {value:g}.{why and ' ' + why}")
        return float(value)
    check.bounds = (lo, hi)   # type: ignore[attr-defined]
    return check


def choice(*options: Any) -> Callable[[Any, str], Any]:
    def check(value: Any, name: str) -> Any:
        if isinstance(value, list | dict) or value not in options:
            listed = ", ".join(map(repr, options[:-1])) + f" or {options[-1]!r}"
            raise ConfigError(f"'{name}' must be {listed}, got {value!r}.")
        return value
    return check


def optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """`check`, or JSON null (the key left out)."""
    def inner(value: Any, name: str) -> Any:
        return None if value is None else check(value, name)
    inner.bounds = getattr(check, "bounds", None)   # type: ignore[attr-defined]
    return inner


def text(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"'{name}' must be a string, got {value!r}.")
    return value


def anything(value: Any, name: str) -> Any:
    return value


def refuse_non_finite(value: Any, name: str = "") -> None:
    """Every number in the config must be finite: JSON files may spell NaN and Infinity, and Python's json reads
    them. lr=inf trains into NaN losses and gradient_clipping=NaN silently turns clipping off (NaN > 0 is false),
    so refuse them wherever they appear, before any key is read."""
    if isinstance(value, dict):
        for k, v in value.items():
            refuse_non_finite(v, f"{name}.{k}" if name else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            refuse_non_finite(v, f"{name}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"'{name}' must be a finite number, got {value!r}. Write the number itself (a limit "
                          "that is off is 0 or the key left out, as DeepSpeed's defaults do).")
