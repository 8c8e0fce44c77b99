"""Typed configs moved to :mod:`speechtrain.common.config` (so that ``data`` can use them without importing
``core``); re-exported for old imports."""

from speechtrain.common.config import (
    ConfigError,
    accepted_keywords,
    find_unknown_keys,
    schema_field,
    to_plain,
    unknown_key_message,
    validate_config,
)

__all__ = [
    "ConfigError",
    "accepted_keywords",
    "find_unknown_keys",
    "schema_field",
    "to_plain",
    "unknown_key_message",
    "validate_config",
]
