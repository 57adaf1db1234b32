"""Config schemas (pydantic, importable without torch) and the ``CMD @ a.toml --a.b v`` loader."""

from prime_rl.common.config.base import (
    BaseConfig,
    ConfigError,
    ConfigWarning,
    asks_for_help,
    load_config,
    load_config_with_sources,
    parse_config,
    to_toml,
    write_toml,
)

__all__ = [
    "BaseConfig",
    "ConfigError",
    "ConfigWarning",
    "asks_for_help",
    "load_config",
    "load_config_with_sources",
    "parse_config",
    "to_toml",
    "write_toml",
]
