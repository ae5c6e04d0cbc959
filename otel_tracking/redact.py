"""Secrets stay out of every backend, span, resource and log line.

A key is secret when its last word names a credential: ``api_key``, ``wandb_api_key``, ``token``,
``hf_token``, ``secret``, ``password``, ``access_key``, ``VOLC_SECRET_ACCESS_KEY``, ...  Only the
*end* of the key counts, so ordinary training knobs such as ``ppo_max_token_len_per_gpu`` or
``max_new_tokens`` are kept.  Redacted values become the string ``"<redacted>"``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"

_SECRET_KEY = re.compile(
    r"(?:^|[^a-z0-9])(?:api[_-]?key|apikey|token|auth[_-]?token|access[_-]?token|secret|secret[_-]?key|"
    r"client[_-]?secret|password|passwd|pwd|access[_-]?key(?:[_-]?id)?|private[_-]?key|credentials?|"
    r"authorization|cookie|sk|ak)$",
    re.IGNORECASE,
)


def is_secret_key(key: object) -> bool:
    return isinstance(key, str) and _SECRET_KEY.search(key) is not None


def redact_config(config: Any) -> Any:
    """A copy of ``config`` (dicts, lists, dataclasses, OmegaConf-like mappings) with secret values replaced."""
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if isinstance(config, Mapping) or _is_mapping_like(config):
        return {k: (REDACTED if is_secret_key(k) else redact_config(v)) for k, v in config.items()}
    if isinstance(config, list):
        return [redact_config(v) for v in config]
    if isinstance(config, tuple):
        return tuple(redact_config(v) for v in config)
    return config


def _is_mapping_like(value: Any) -> bool:
    # OmegaConf DictConfig and similar: items() but not a Mapping subclass.
    return hasattr(value, "items") and hasattr(value, "keys") and not isinstance(value, (str, bytes))


def redact_header_values(names: Iterable[str]) -> str:
    names = list(names)
    if not names:
        return ""
    return " headers: " + ", ".join(f"{name}={REDACTED}" for name in names)


_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@]+@")


def scrub_text(text: str) -> str:
    """A message safe to print: credentials in URLs (``scheme://user:password@host``) removed."""
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
