"""The configuration error, in a module of its own so that any module (a user's code by import path, the devices,
the checkpoints) can raise it without importing the option machinery."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names key, value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str, message: str = "") -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(message or f"config key '{key}' = {value!r} is not allowed: expected {allowed}")
