"""Converting config values by type with msgspec: the layers of kvtier.config, merged.

Each value is converted where it is read, by its field's annotation (``msgspec.convert``
with the ``Meta`` ranges of the annotation, enums by value, ``ByteSize`` and ``Path``
through ``_dec_hook``), so an error names the setting and where the value came from.
TOML values are typed; env and flag values are text, read the way a person writes them
(``yes``/``off`` for booleans, digits for integers) before the same conversion.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from kvtier.errors import ConfigError, brief
from kvtier.files import NotRegularFile, TooLarge, read_regular
from kvtier.units import ByteSize, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")
_INT_RE = re.compile(r"^\s*[+-]?\d+\s*$")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """One field of the tree: ``section.name`` with its annotation."""

    section: str
    name: str
    annotation: Any

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def base(self) -> Any:
        """The annotation without ``Annotated`` metadata and without ``| None``."""
        return _base(self.annotation)

    @property
    def optional(self) -> bool:
        return _is_optional(self.annotation)


def _strip_annotated(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def _is_optional(tp: Any) -> bool:
    tp = _strip_annotated(tp)
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and \
        type(None) in typing.get_args(tp)


def _base(tp: Any) -> Any:
    tp = _strip_annotated(tp)
    if _is_optional(tp):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = _strip_annotated(rest[0]) if len(rest) == 1 else tp
    return tp


@functools.cache
def settings(tree: type) -> dict[str, dict[str, Setting]]:
    """Every field of the tree's sections, in declaration order."""
    out: dict[str, dict[str, Setting]] = {}
    for sec in dataclasses.fields(tree):
        cls = typing.get_type_hints(tree)[sec.name]
        hints = typing.get_type_hints(cls, include_extras=True)
        out[sec.name] = {f.name: Setting(sec.name, f.name, hints[f.name])
                         for f in dataclasses.fields(cls)}
    return out


def iter_settings(tree: type) -> Iterator[Setting]:
    for section in settings(tree).values():
        yield from section.values()


def _dec_hook(tp: type, obj: Any) -> Any:
    """Types msgspec does not know: sizes (``4GiB``) and paths (``~`` expanded)."""
    if tp is ByteSize:
        try:
            return ByteSize(parse_size(obj))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    if tp is Path:
        if not isinstance(obj, str | Path):
            raise ValueError(f"must be a path (a string), not {type(obj).__name__}")
        text = str(obj)
        if not text.strip():
            raise ValueError("must not be empty (an empty path would mean the current "
                             "directory)")
        if "\0" in text:
            raise ValueError("must not contain a NUL byte")
        try:
            return Path(text).expanduser()
        except RuntimeError as exc:   # ~user with no such user, or no home directory
            raise ValueError(str(exc)) from None
    raise NotImplementedError(f"no conversion to {tp}")


def _from_text(value: Any, s: Setting) -> Any:
    """A value as its type's converter takes it: text words for booleans and integers,
    empty text for an optional field is unset, and non-finite floats are refused."""
    base = s.base
    if isinstance(value, str):
        text = value.strip()
        if s.optional and not text:
            return None
        if base is bool:
            low = text.lower()
            return True if low in _TRUE else False if low in _FALSE else value
        if base is int:
            return int(text) if _INT_RE.match(text) else value
        if base is float:
            try:
                value = float(text)
            except ValueError:
                return value
        elif isinstance(base, type) and issubclass(base, Enum):
            return text.lower()
        elif base is str:
            return value
    if base is bool and type(value) is int and value in (0, 1):
        return bool(value)
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    if base is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def convert_value(s: Setting, value: Any, source: str) -> Any:
    """``value`` converted to ``s``'s type, or a ConfigError naming the setting and source."""
    try:
        return msgspec.convert(_from_text(value, s), s.annotation, dec_hook=_dec_hook)
    except (msgspec.ValidationError, ValueError, TypeError, OverflowError) as exc:
        why = str(exc).replace(" - at `$`", "")
        base = s.base
        if isinstance(base, type) and issubclass(base, Enum):
            why = f"must be one of {', '.join(str(m.value) for m in base)}"
        # the value named in a few dozen characters (found by review: a 900 KB bad string
        # made a 1.8 MB "one-line" error)
        if len(why) > 200:
            why = why[:197] + "..."
        raise ConfigError(f"{s.dotted}: invalid value {brief(value)} ({why}; from {source})") \
            from None


def anchored(value: Any, base: Path | None, source: str) -> Any:
    """A relative path made absolute: against ``base`` (the TOML file's directory, for the
    file's values) or the working directory (env and flags, as a shell reads them).

    Each process would otherwise resolve it against its own working directory: a daemon
    under systemd (``/``) and a client started elsewhere would look in two places, and
    the daemon's logs and ``kvtier stats`` would name a path no reader can place."""
    if not isinstance(value, Path) or value.is_absolute():
        return value
    try:
        return (base / value if base is not None else value).absolute()   # '..' kept as is
    except OSError as exc:   # the working directory was removed
        raise ConfigError(f"{source}: relative path {value} cannot be placed ({exc}); "
                          "give an absolute path") from None


def _lookup(tree: type, section: str, name: str, source: str) -> Setting:
    known = settings(tree)
    if section not in known:
        raise ConfigError(f"{source}: unknown section [{section}]")
    if name not in known[section]:
        raise ConfigError(f"{source}: unknown setting {section}.{name}; "
                          f"known: {', '.join(sorted(known[section]))}")
    return known[section][name]


MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this is refused (a device or a log given by mistake)."""


def _read_config(path: Path) -> str:
    """A regular file of at most ``MAX_CONFIG_BYTES`` (``kvtier.files.read_regular``), as
    text; /dev/null is no settings (a common way to say "defaults only")."""
    try:
        data = read_regular(path, MAX_CONFIG_BYTES, devnull_ok=True)
    except NotRegularFile:
        raise ConfigError(f"config file {path} is not a regular file: give a TOML file") \
            from None
    except TooLarge:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes: give "
                          "a TOML file") from None
    return data.decode("utf-8")   # TOML is UTF-8


def _file_layer(tree: type, path: Path) -> Iterator[tuple[Setting, Any, str]]:
    try:
        data = tomllib.loads(_read_config(path))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text: give a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}; check that it is a "
                          "readable file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except RecursionError:   # (found by review: 2000 nested arrays in 4 KB, a traceback)
        raise ConfigError(f"config file {path} nests arrays or tables too deeply: give a "
                          "kvtier TOML file (its values are numbers, strings and booleans)") \
            from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
        for name, value in values.items():
            yield _lookup(tree, section, name, str(path)), value, str(path)


def _env_layer(tree: type, environ: Mapping[str, str],
               aliases: Mapping[str, tuple[str, str]]) -> Iterator[tuple[Setting, Any, str]]:
    for key, value in sorted(environ.items()):
        if not key.startswith("KVTIER_"):
            continue
        if key in aliases:
            section, name = aliases[key]
        else:
            section, _, name = key[len("KVTIER_"):].lower().partition("_")
            if section not in settings(tree) or not name:
                continue  # not ours (e.g. KVTIER_TEST_*): ignore rather than fail
        yield _lookup(tree, section, name, f"env {key}"), value, f"env {key}"


def build(tree: type[T], path: str | Path | None, environ: Mapping[str, str],
          overrides: Mapping[str, Any], aliases: Mapping[str, tuple[str, str]],
          validate: Callable[[T], None],
          imply: Callable[[dict[str, dict[str, Any]], dict[tuple[str, str], int]], None]
          | None = None) -> T:
    """Defaults < TOML file < env < overrides (``section.field`` -> value, None = unset).

    ``imply(values, source)`` sees the merged settings (section -> field -> value) and
    which source set each (0 file, 1 env, 2 overrides) before the tree is built, and may
    add what they imply (a Redis URL turns the tier on unless a source as high says
    otherwise)."""
    known: type = tree
    chosen: dict[str, dict[str, Any]] = {section: {} for section in settings(known)}
    source: dict[tuple[str, str], int] = {}

    def take(layer: Iterator[tuple[Setting, Any, str]], rank: int,
             base: Path | None = None) -> None:
        for s, value, where in layer:
            chosen[s.section][s.name] = anchored(convert_value(s, value, where), base, where)
            source[(s.section, s.name)] = rank

    if path is not None:
        take(_file_layer(tree, Path(path)), 0, Path(path).parent)
    take(_env_layer(tree, environ, aliases), 1)
    take(((_lookup(tree, *dotted.partition(".")[::2], f"flag {dotted}"), value,
           f"flag {dotted}") for dotted, value in overrides.items() if value is not None), 2)
    if imply is not None:
        imply(chosen, source)
    hints = typing.get_type_hints(tree)
    cfg = tree(**{section: hints[section](**values) for section, values in chosen.items()})
    validate(cfg)
    return cfg


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, ByteSize):
        return int(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def to_builtins(cfg: Any) -> dict[str, Any]:
    """The tree as plain dicts (paths as text, enums as values, sizes as ints)."""
    out: dict[str, Any] = msgspec.to_builtins(cfg, enc_hook=_enc_hook)
    return out
