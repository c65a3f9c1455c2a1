"""One typed config object is the YAML/TOML file, the CLI flags and the logged config.

A dataclass declares the options once (type, default, help). The CLI gets a flag per field, a
`--config FILE` gets the same keys, flags override the file, and an unknown key in either is an error
that lists the known ones. The class's `RANGES` (field -> tierlm.validate.Num or Size) are checked as
the config is built, so flags, files and the Python API refuse a NaN learning rate alike, before a
run directory exists; the error names the flag, or the key and its file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path


class ConfigError(ValueError):
    pass


def _base_type(tp):
    """int | None -> (int, optional=True)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def _coerce(name: str, tp, value):
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required")
    if typing.get_origin(base) is list:  # a repeatable flag, or one value or a list in a file
        (item,) = typing.get_args(base)
        return [_coerce(name, item, v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if base in (int, float) and isinstance(value, bool):  # YAML's `lr: yes` is no learning rate of 1
            raise ValueError(value)
        if base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if base is float:
            return float(value)
        if base is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {base.__name__}, got {value!r}") from None
    return value


def fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def add_arguments(parser: argparse.ArgumentParser, cls, positional: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for name, f in fields(cls).items():
        helptext = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        rng = getattr(cls, "RANGES", {}).get(name)
        shown = default not in (None, dataclasses.MISSING, "")  # an empty default is no value to show
        if shown or rng:
            helptext += " (" + "; ".join(filter(None, [
                f"default: {default}" if shown else "",
                rng.describe() if rng else ""])) + ")"
        base, _ = _base_type(hints[name])
        choices = f.metadata.get("choices")
        if name in positional:
            parser.add_argument(name, help=helptext, nargs="?", default=None, choices=choices)
            continue
        flag = "--" + name.replace("_", "-")
        if typing.get_origin(base) is list and f.metadata.get("nargs"):  # `--flag A B C`
            parser.add_argument(flag, dest=name, nargs=f.metadata["nargs"], default=None, help=helptext,
                                metavar=f.metadata.get("metavar"))
        elif typing.get_origin(base) is list:
            parser.add_argument(flag, dest=name, action="append", default=None, help=helptext + " (repeatable)",
                                metavar=f.metadata.get("metavar"))
        elif base is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            parser.add_argument(flag, dest=name, default=None, help=helptext, choices=choices,
                                type=str if base not in (int, float) else base, metavar=f.metadata.get("metavar"))
    parser.add_argument("--config", dest="_config_file", default=None, metavar="FILE",
                        help="a YAML or TOML file with the same keys as these flags; flags override it")


def load_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            import tomllib
            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text) or {}
    except Exception as e:  # the parsers' own messages name the line
        raise ConfigError(f"--config {path}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build(cls, *layers: dict, source: str = "config", name_of=None):
    """Instantiate `cls` from dicts of options, later ones overriding; unknown keys fail, and so do
    values outside `cls.RANGES`. name_of(field) -> how errors name it (a flag, a key in a file)."""
    known = fields(cls)
    hints = typing.get_type_hints(cls)
    name_of = name_of or (lambda n: n)
    merged: dict = {}
    for layer in layers:
        for k, v in layer.items():
            if k not in known:
                close = [n for n in known if n.startswith(k[:3])]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown option {k!r} in {source}{hint}; known options: {', '.join(known)}")
            if v is not None:
                merged[k] = v
    kwargs = {}
    for name, f in known.items():
        if name in merged:
            val = _coerce(name_of(name), hints[name], merged[name])
            choices = f.metadata.get("choices")
            if choices and val not in choices:
                raise ConfigError(f"{name_of(name)}: {val!r} is not one of {', '.join(map(str, choices))}")
            _check_range(cls, name, val, name_of(name))
            kwargs[name] = val
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{name} is required (flag --{name.replace('_', '-')} or key {name!r} in --config)")
    return cls(**kwargs)


def _check_range(cls, field: str, value, name: str) -> None:
    rng = getattr(cls, "RANGES", {}).get(field)
    if rng is not None:
        try:
            rng.check(value, name)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check(obj) -> None:
    """The ranges of an already built config (one made with `cls(...)` in Python, not `build`)."""
    for name in fields(type(obj)):
        _check_range(type(obj), name, getattr(obj, name), name)


def from_args(cls, args: argparse.Namespace):
    file = getattr(args, "_config_file", None)
    file_layer = load_file(file) if file else {}
    cli_layer = {k: v for k, v in vars(args).items() if k in fields(cls) and v is not None}
    src = f"--config {file}" if file else "options"
    def name_of(n: str) -> str:  # a bad value is named as the user wrote it: the flag, or the key in the file
        return f"{n} in --config {file}" if n in file_layer and n not in cli_layer else "--" + n.replace("_", "-")

    return build(cls, file_layer, cli_layer, source=src, name_of=name_of)


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def option(default=dataclasses.MISSING, help: str = "", choices=None, metavar=None, default_factory=dataclasses.MISSING,
           nargs=None):
    """nargs: a list option's values after one flag (argparse's nargs, e.g. "*"), where the flag is
    not repeated for each."""
    md = {"help": help}
    if choices:
        md["choices"] = tuple(choices)
    if metavar:
        md["metavar"] = metavar
    if nargs:
        md["nargs"] = nargs
    return dataclasses.field(default=default, default_factory=default_factory, metadata=md)
