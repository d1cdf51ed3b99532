"""``--config FILE``: a command's flags read from a YAML file, as vLLM's ``vllm serve --config`` reads them.

The file is a mapping from flag names (without ``--``; ``-`` or ``_`` between words) to values. Its flags go before
those of the command line, so a flag given on the command line wins (argparse keeps the last value). A value becomes
what the flag takes on a command line: ``true`` and ``false`` turn a switch on and off, a list gives a flag that takes
several values each of them, a mapping gives a JSON flag (``speculative-config``, ``hf-overrides``) its JSON text, and a
boolean gives a flag of words (``kv-lending``) ``on`` or ``off``: YAML reads ``on``, ``off``, ``yes`` and ``no`` as
booleans.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    """The config file cannot be read, or names a flag the command does not take."""


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """Declare ``--config`` on ``parser`` (read by :func:`expand_config_file` before parsing; listed by ``--help``)."""
    parser.add_argument(
        CONFIG_FLAG,
        metavar="YAML",
        help="read flags from this YAML file (flag names as keys, without --); flags on the command line win",
    )


def expand_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` (a command's arguments, for ``parser``) with the flags of its ``--config`` file put before them; as
    given when there is none."""
    path = _config_path(parser, argv)
    if path is None:
        return list(argv)
    return [*flags_of(parser, read_config_file(path), path), *argv]


def _config_path(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        name, given, value = arg.partition("=")
        if _names_config(parser, name):
            if given:
                return value
            if i + 1 == len(argv):
                raise ConfigFileError(f"{CONFIG_FLAG} needs a file's path")
            return argv[i + 1]
    return None


def _names_config(parser: argparse.ArgumentParser, name: str) -> bool:
    """Whether argparse reads ``name`` as ``--config``: the flag, or a prefix of it that starts no other flag (argparse
    takes such abbreviations, ``--conf``; unseen here, the file's flags were silently left out)."""
    if not (name.startswith("--") and CONFIG_FLAG.startswith(name) and len(name) > 2):
        return False
    return name == CONFIG_FLAG or (
        parser.allow_abbrev and all(f == CONFIG_FLAG or not f.startswith(name) for f in parser._option_string_actions)
    )


def read_config_file(path: str) -> dict[str, Any]:
    """The file's mapping of flag names to values."""
    import yaml

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: cannot read it ({e})") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: not YAML ({getattr(e, 'problem', None) or e}{where})") from e
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: the file must be a mapping of flag names to values")
    return data


def flags_of(parser: argparse.ArgumentParser, values: dict[str, Any], path: str) -> list[str]:
    """The command-line flags that say what ``values`` (flag name -> value) say, for ``parser``."""
    actions = parser._option_string_actions  # (argparse keeps no public map of its flags)
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + key.removeprefix("--").replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == CONFIG_FLAG or action.dest == "help":
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: {key!r} is not a flag of this command")
        if isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-"):
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: {key!r}: write the switch's own name, {flag[5:]}: false")
        if value is None:
            continue  # (YAML's empty value: the flag's default)
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigFileError(f"{CONFIG_FLAG} {path}: {key!r} is a switch: true or false, not {value!r}")
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif action.nargs == 0:  # store_true and the like
            if not isinstance(value, bool):
                raise ConfigFileError(f"{CONFIG_FLAG} {path}: {key!r} is a switch: true or false, not {value!r}")
            if value:
                argv.append(flag)
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            argv += [flag, *map(_text, value)]
        elif isinstance(value, bool):
            # A flag of words given a YAML boolean: YAML 1.1 (PyYAML's) reads on/off and yes/no as true/false, so
            # "kv-lending: on" came as "true", refused as not on or off. Such flags say on and off.
            argv += [flag, "on" if value else "off"]
        else:
            argv.append(f"{flag}={_text(value)}")  # (one word: a value starting with "-" is the flag's, not a flag)
    return argv


def _text(value: Any) -> str:
    """A value as the command line writes it: JSON for a mapping or a list, ``true`` / ``false`` for a boolean."""
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
