"""Typed configs: every YAML node maps to a dataclass, and a misspelt key fails at start with a suggestion.

A schema is a dataclass. A field whose type is another dataclass is checked recursively; a free-form field (a
``dict``) can still be checked against a callable's keyword arguments with ``field(metadata={"keys_from": fn})``
(how the ``trainer`` node is checked against ``lightning.Trainer``), or hold a partial config of a dataclass with
``field(metadata={"overrides_of": SomeConfig})``: only the keys present are checked, nothing is filled in (how a
fine-tuning job's ``model`` node overrides the pretrained model's config).
"""

import copy
import dataclasses
import difflib
import inspect
import logging
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config does not fit its schema: unknown key, wrong type or missing value."""


def _dataclass_of(annotation: Any) -> type | None:
    """The dataclass inside ``annotation`` (``X``, ``X | None``, ``Optional[X]``), if any."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def nested_schema(f: dataclasses.Field) -> type | None:
    """The dataclass whose keys a field's value holds: its type's, or its ``overrides_of`` one."""
    return _dataclass_of(f.type) or f.metadata.get("overrides_of")


def accepted_keywords(fn: Callable) -> set[str] | None:
    """Keyword names ``fn`` accepts, or None when it takes ``**kwargs``."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.name != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL}


def schema_field(schema: type, dotted_key: str) -> dataclasses.Field | None:
    """The dataclass field that ``dotted_key`` names inside ``schema`` (following nested dataclasses and
    ``overrides_of`` nodes), if any."""
    node: type | None = schema
    found = None
    for part in dotted_key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if node is not None else {}
        found = fields.get(part)
        if found is None:
            return None
        node = nested_schema(found)
    return found


def unknown_key_message(path: str, key: str, allowed: set[str]) -> str:
    """``Unknown config key 'path.key'.`` with the closest allowed key, or the list of allowed keys."""
    guess = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
    where = f"{path}.{key}" if path else key
    prefix = f"{path}." if path else ""
    hint = f" Did you mean '{prefix}{guess[0]}'?" if guess else f" Known keys here: {', '.join(sorted(allowed))}."
    return f"Unknown config key '{where}'.{hint}"


def find_unknown_keys(config: Mapping[str, Any], schema: type, path: str = "") -> list[str]:
    """Messages for every key of ``config`` that ``schema`` (a dataclass) does not define, recursively."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems = []
    for key, value in config.items():
        if key not in fields:
            problems.append(unknown_key_message(path, str(key), set(fields)))
            continue
        child_path = f"{path}.{key}" if path else str(key)
        nested = nested_schema(fields[key])
        keys_from = fields[key].metadata.get("keys_from")
        if nested is not None and isinstance(value, Mapping):
            problems += find_unknown_keys(value, nested, child_path)
        elif keys_from is not None and isinstance(value, Mapping):
            allowed = accepted_keywords(keys_from)
            if allowed is not None:
                problems += [unknown_key_message(child_path, str(k), allowed) for k in value if k not in allowed]
    return problems


def expand_given(config: Mapping[str, Any], schema: type) -> dict[str, Any]:
    """``config`` (only the keys the user gave) with each dataclass node's ``expand_given(node) -> node`` applied,
    innermost first, before any default is filled in: a hook that fills keys from a preset (e.g. a model ``size``)
    sees exactly what was given, so an explicit key always wins, even one equal to the schema's default."""
    result = dict(config)
    for f in dataclasses.fields(schema):
        nested = _dataclass_of(f.type)
        if nested is not None and isinstance(result.get(f.name), Mapping):
            result[f.name] = expand_given(result[f.name], nested)
    hook = getattr(schema, "expand_given", None)
    return dict(hook(result)) if callable(hook) else result


def validate_config(config: Mapping[str, Any] | DictConfig, schema: type) -> DictConfig:
    """Check ``config`` against ``schema`` and return it merged onto the schema's defaults.

    Raises:
        ConfigError: naming every unknown key (with the closest known key), or the key with a wrong type.
    """
    if not dataclasses.is_dataclass(schema):
        raise TypeError(f"schema must be a dataclass, got {schema!r}")
    if isinstance(config, DictConfig):
        plain = OmegaConf.to_container(config, resolve=False)
    else:
        plain = dict(config)
    problems = find_unknown_keys(plain, schema)
    if problems:
        raise ConfigError("\n".join(problems))
    plain = expand_given(plain, schema)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), plain)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or ""
        reason = getattr(error, "msg", None) or str(error)
        raise ConfigError(f"Invalid value for config key '{key}': {reason}") from error
    return merged


def to_plain(config: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A resolved, plain ``dict`` copy of ``config``."""
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return OmegaConf.to_container(OmegaConf.create(dict(config)), resolve=True)


# ---------------------------------------------------------------------------------------- environment values
# A config may read environment variables (``${oc.env:DATA_ROOT}/train.json``, a tracker's API key): the run uses
# their values, but what it saves for others (archives, checkpoints' trainer configs, trackers' hyperparameters)
# keeps the interpolation text, never the value.
_READS_ENVIRONMENT = re.compile(r"\$\{\s*(?:oc\.env|env)\s*:")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # ${a.b}: another key's value


def env_interpolations(config: DictConfig | Mapping[str, Any] | list) -> dict[str, str]:
    """Dotted key -> interpolation text of every value of ``config`` (unresolved) that reads the environment."""
    raw = OmegaConf.to_container(config, resolve=False) if OmegaConf.is_config(config) else config
    found: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            walk(value, f"{prefix}{key}.")
        if isinstance(node, str) and _READS_ENVIRONMENT.search(node):
            found[prefix[:-1]] = node

    walk(raw, "")
    # A value that refers to one of those (``${model.data_root}/train.json``) reads the environment too: recorded
    # with the reference replaced by the text it refers to, so that it holds without the rest of the config.
    strings: dict[str, str] = {}

    def collect(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            collect(value, f"{prefix}{key}.")
        if isinstance(node, str) and "${" in node:
            strings[prefix[:-1]] = node

    collect(raw, "")
    for _ in range(len(strings)):
        changed = False
        for key, text in strings.items():
            whole = _REFERENCE.fullmatch(text)
            for inner, inner_text in list(found.items()) if whole else ():  # ${model.data}: a node holding some
                if inner.startswith(whole.group(1) + ".") and found.get(key + inner[len(whole.group(1)) :]) is None:
                    found[key + inner[len(whole.group(1)) :]], changed = inner_text, True
            refers = _REFERENCE.sub(lambda m: found.get(m.group(1), m.group(0)), text)
            if refers != text and found.get(key) != refers:
                found[key], changed = refers, True
        if not changed:
            break
    return found


def with_env_interpolations(plain: Any, interpolations: Mapping[str, Any]) -> Any:
    """A copy of the resolved ``plain`` with each value named in ``interpolations`` (from :func:`env_interpolations`
    of the config it was resolved from) put back as its interpolation text; keys no longer present are skipped."""
    out = copy.deepcopy(plain)
    for dotted, text in interpolations.items():
        *parents, last = dotted.split(".")
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        else:
            if isinstance(node, dict) and last in node:
                node[last] = text
            elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
                node[int(last)] = text
    return out


def settle_env_interpolations(config: dict[str, Any], source: Any) -> dict[str, Any]:
    """A saved config made loadable here: a value that reads an environment variable this process does not have
    becomes None (its text would be resolved again wherever the config is used; the note names ``source`` and the
    keys); the others resolve from this process's environment when the config is used."""
    unset: dict[str, Any] = {}
    for dotted, text in env_interpolations(config).items():
        try:
            OmegaConf.create({"value": text}).value  # noqa: B018 (resolved on access)
        except OmegaConfBaseException:
            unset[dotted] = None
    if unset:
        logger.info("%s: %s read environment variables not set here; left empty.", source, ", ".join(sorted(unset)))
    return with_env_interpolations(config, unset)
