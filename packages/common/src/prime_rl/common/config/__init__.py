"""Config schemas (pydantic, importable without torch) and the ``CMD @ a.toml --a.b v`` loader."""

from prime_rl.common.config.base import BaseConfig, ConfigError, load_config, parse_config, to_toml, write_toml

__all__ = ["BaseConfig", "ConfigError", "load_config", "parse_config", "to_toml", "write_toml"]
