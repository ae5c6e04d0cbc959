"""Secrets stay out of every backend, span, resource and log line: by key and by value.

**By key.**  A key is secret when its last words name a credential: ``api_key``, ``token``,
``hf_token``, ``secret``, ``password``, ``passphrase``, ``access_key``, ``access_key_id``,
``private_key``, ``credentials``, ``authorization``, ``cookie``, ``VOLC_SECRET_ACCESS_KEY``, ...
Keys are split into words at ``_``, ``-``, ``.``, spaces and camelCase humps, so ``hfToken``,
``wandbApiKey``, ``auth.token`` and ``HF_TOKEN`` are the same to it.  Only the *end* of the key
counts: ``ppo_max_token_len_per_gpu``, ``max_new_tokens`` and ``bos_token_id`` are kept, and so
are the tokenizer's special tokens (``pad_token``, ``eos_token``, ``bos_token``, ``unk_token``,
``sep_token``, ``cls_token``, ``mask_token``, ``im_start_token``, ...), which every RL config has
and which are not credentials.  The value of a secret key becomes ``"<redacted>"``, whatever it
is (a nested dict under ``credentials`` goes whole).

**By value.**  Every string, under any key, is scanned; what matches is replaced, the rest kept:

* URL userinfo: ``http://user:pw@proxy:8080`` -> ``http://<redacted>@proxy:8080``.  The whole
  userinfo goes, not only the password: a user name is often a token itself
  (``https://ghp_...@github.com``, ``https://<key>@sentry.io``).  Scheme, host, port and path are
  kept, so a proxy or a database is still recognisable.  The userinfo ends at the last ``@``
  before the path, so a password with an unencoded ``@`` goes whole too; RFC 3986 wants ``/`` in
  a password percent-encoded, and a password with a raw ``/`` is not recognised.
* ``name=value`` pairs inside text (query strings, libpq DSNs, Hydra overrides, CLI flags) whose
  name is a secret key: ``?access_token=abc`` -> ``?access_token=<redacted>``,
  ``data.hf_token=x`` -> ``data.hf_token=<redacted>``; a quoted value goes inside its quotes
  (``password='a b'``, as ``str(argparse.Namespace)`` and libpq print it).
* ``"name": "value"`` pairs of JSON (or a dict's repr) inside text whose name is a secret key.
* Well-known credential formats, after the plugins of ``detect-secrets`` (Yelp, 1.5): provider
  key prefixes (``sk-``, ``sk_live_``/``rk_live_``, ``ghp_``/``gho_``/``ghu_``/``ghs_``/
  ``ghr_``/``github_pat_``, ``glpat-``, ``hf_``, ``xox[abprs]-``, ``npm_``, ``pypi-AgEI``,
  ``AIza``, ``SG.``), AWS access key ids (``AKIA``/``ASIA``/...), JWTs, PEM private-key blocks
  (an unterminated block goes to the end of the text), Slack webhook paths and ``Bearer`` tokens.
  What is *not* recognisable by value stays the key rule's job: a wandb API key is 40 hex
  characters, exactly like a git commit id.

Every pass is linear in the text (``bench/bench_scrub.py``: runs of each character the patterns
use, 1 MB): a collapsed generation of ``=`` signs must not stall ``log()``.

**Why no detect-secrets dependency** (measured: ``bench/bench_scrub.py``, and
``bench/results/2026-12-02-scrub.md``): importing any of its plugins imports ``requests``,
``urllib3`` and ``yaml``, which ``Tracking(..., "file")`` otherwise never loads, and would about
double start-up, in the bridge process too; its regex plugins cost far more per config value than
the one search for any trigger done here.  Its plugins also miss formats the issue names (``hf_`` tokens,
``sk-proj-``/``sk-ant-`` keys without OpenAI's ``T3BlbkFJ`` marker), and some report a capture
group instead of the secret (``GitHubTokenDetector`` yields ``"ghp"``), so redaction would still
need patterns of our own.  The patterns here follow those plugins, widened for newer formats.

**Where it applies**: the config every backend gets (``redact_config``); ``log()`` values that
are not numbers (strings, however nested, by value only: ``log()`` keys name metrics, not
settings); every span and log record, once, on its way out of the run
(``delivery/scrubbing.py``: attributes, labels among them, events, exceptions and status of a
span; body and attributes of an event, validation generations included: they are model text, but
an agent's prompt can carry a tool's key; text with an ``@`` or ``=`` in it costs the most to
scan, once per validation step); resource
attributes; the argv the bridge process hands to trackers; the OTLP endpoint we show; and every
record our loggers emit (:class:`ScrubFilter`, on each of them: a logger's filter does not see
its children's records).  Numbers are never touched.  A credential glued to a word
(``ask-proj-...``) is another word, not a key.  What a tracker reads by itself in the training
process when it runs there (``OTEL_TRACKING_BRIDGE_PROCESS=false``: wandb records ``sys.argv``)
is outside our reach.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"

# --- by key -----------------------------------------------------------------------------------

# camelCase humps: "wandbApiKey" -> "wandb_Api_Key", "HFToken" -> "HF_Token".
_HUMPS = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_SEPARATORS = re.compile(r"[^a-z0-9]+")
# A key whose last word is one of these is secret.
_SECRET_LAST_WORDS = frozenset(
    {
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "authorization",
        "cookie",
        "sk",  # Volcengine's and others' "secret key" abbreviations
        "ak",
    }
)
# "<word>_key" is secret for these words ("prompt_key", "reward_fn_key", "sort_key" are not).
_SECRET_KEY_KINDS = frozenset(
    {"api", "secret", "access", "private", "account", "signing", "encryption", "master", "client", "session"}
)
# "<word>_token" that names a tokenizer's special token, not a credential.
_TOKENIZER_TOKENS = frozenset(
    {
        "pad",
        "eos",
        "bos",
        "unk",
        "sep",
        "cls",
        "mask",
        "eot",
        "eom",
        "boi",
        "eoi",
        "start",  # im_start_token, vision_start_token, decoder_start_token
        "end",
        "image",
        "video",
        "audio",
        "think",
        "special",
        "placeholder",
    }
)


def key_words(key: str) -> list[str]:
    """``"wandbApiKey"`` -> ``["wandb", "api", "key"]``; ``"auth.token"`` -> ``["auth", "token"]``."""
    return [word for word in _SEPARATORS.split(_HUMPS.sub("_", key).lower()) if word]


# Every span's attribute keys are looked at (delivery/scrubbing.py): the same few, again and again.
@functools.lru_cache(maxsize=4096)
def is_secret_key(key: object) -> bool:
    if not isinstance(key, str):
        return False
    words = key_words(key)
    if not words:
        return False
    last = words[-1]
    before = words[-2] if len(words) > 1 else ""
    if last == "token":
        return before not in _TOKENIZER_TOKENS
    if last in _SECRET_LAST_WORDS:
        return True
    if last == "key":
        return before in _SECRET_KEY_KINDS
    if last == "id":  # access_key_id (AWS, Volcengine): half of a key pair
        return before == "key" and len(words) > 2 and words[-3] in _SECRET_KEY_KINDS
    return False


# --- by value ---------------------------------------------------------------------------------

# Each pass runs only when its literal is in the text (``in`` is ~1 GB/s; a regex that may start at
# any letter is ~20 MB/s), and each pattern starts with that literal where it can, so the regex
# engine jumps between its occurrences.  A match's group "s" is replaced, or the whole match.
# Formats after detect-secrets' plugins (aws, github_token, gitlab_token, jwt, private_key, slack,
# stripe, npm, pypi_token, sendgrid, basic_auth), widened where they miss newer formats.
_FORMATS: list[tuple[tuple[str, ...], re.Pattern[str]]] = [
    # PEM private keys, to their END line (or to the end of the text)
    (
        ("-----BEGIN",),
        re.compile(
            r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|.*)",
            re.DOTALL,
        ),
    ),
    # URL userinfo, up to the last "@" before the path: scheme://<userinfo>@host
    (("://",), re.compile(r"://(?P<s>[^/?#\s]*)@")),
    # Slack incoming webhooks: the path is the secret
    (("hooks.slack.com/",), re.compile(r"hooks\.slack\.com/(?:services|workflows)/(?P<s>[A-Za-z0-9/_+-]+)")),
    # JWTs: base64url JSON header and payload ("eyJ" is '{"'), then the signature
    # (only where a run of its characters starts: "eyJeyJeyJ..." is tried once, not at every "eyJ")
    (("eyJ",), re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*")),
    # Authorization header values quoted in text
    (("Bearer",), re.compile(r"Bearer\s+(?P<s>[A-Za-z0-9._~+/-]{16,}=*)")),
    # provider keys by prefix
    (("sk-",), re.compile(r"\bsk-[A-Za-z0-9_-]{20,}")),  # OpenAI (sk-, sk-proj-), Anthropic (sk-ant-), ...
    (("sk_", "rk_"), re.compile(r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}")),  # Stripe
    (  # GitHub
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
        re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9_]{30,}|github_pat_[A-Za-z0-9_]{22,})"),
    ),
    (("glpat-",), re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}")),  # GitLab
    (("hf_",), re.compile(r"\bhf_[A-Za-z0-9]{30,}")),  # Hugging Face
    (("xox",), re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),  # Slack
    (("npm_",), re.compile(r"\bnpm_[A-Za-z0-9]{36}")),  # npm
    (("pypi-",), re.compile(r"\bpypi-AgEIcHlwaS5vcmc[A-Za-z0-9_-]{50,}")),  # PyPI
    (("AIza",), re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),  # Google API keys
    (("SG.",), re.compile(r"\bSG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}")),  # SendGrid
    (  # AWS access key ids
        ("AKIA", "ASIA", "ABIA", "ACCA", "A3T"),
        re.compile(r"\b(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b"),
    ),
]
# Any of the literals (or "=" for name=value pairs): the one search most strings end with.
_ANY = re.compile("|".join(re.escape(literal) for literals, _ in _FORMATS for literal in literals) + "|=|[\"']\\s*:")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_PAIR_VALUE = re.compile(r"[^\s&;,'\"]*")


def _replace(match: re.Match[str]) -> str:
    if match.re.groupindex.get("s") is None:
        return REDACTED
    text, start = match.group(0), match.start()
    return text[: match.start("s") - start] + REDACTED + text[match.end("s") - start :]


def _pair_value(text: str, start: int) -> tuple[int, int]:
    """Where the value after ``name=`` at ``start`` begins and ends: inside its quotes when it is
    quoted (``password='a b'``, as ``str(argparse.Namespace)`` and libpq DSNs print them; an
    unclosed quote: its first word), else up to a separator."""
    if start < len(text) and text[start] in "'\"":
        close = text.find(text[start], start + 1)
        if close != -1:
            return start + 1, close
        start += 1
    return start, _PAIR_VALUE.match(text, start).end()  # type: ignore[union-attr]


# JSON (or a Python dict's repr) inside a string: "api_key": "..." / 'api_key': '...'.  The value
# ends at its closing quote, so a scan from one key never passes the next quote: linear.
_QUOTED_PAIRS = [
    re.compile(f"{q}(?P<k>[A-Za-z][A-Za-z0-9_.-]{{0,127}}){q}" + r"\s*:\s*" + f"{q}(?P<v>(?:[^{q}\\\\\\n]|\\\\.)*){q}")
    for q in ('"', "'")
]


def _redact_quoted_pair(match: re.Match[str]) -> str:
    if not is_secret_key(match.group("k")):
        return match.group(0)
    text, start = match.group(0), match.start()
    return text[: match.start("v") - start] + REDACTED + text[match.end("v") - start :]


_MAX_NAME = 128  # characters looked at before an "=": a longer name is judged by its end
_NAMED_SIGN = re.compile(r"(?<=[A-Za-z0-9_.-])=")  # an "=" right after a name character (found in C)


def _scrub_pairs(text: str) -> str:
    """``name=value`` with a secret name: the value goes.  Walks the ``=`` signs (a regex that
    looks for a name before each would try every letter of the text).  Linear in the text: a
    name is looked for back to the previous ``=`` (at most ``_MAX_NAME`` characters), and a value
    only after a secret name, so ``"===="`` or ``"a=a=a="`` costs one look per sign."""
    parts: list[str] = []
    done = 0
    found = _NAMED_SIGN.search(text)
    while found is not None:
        sign = start = found.start()
        floor = max(done, sign - _MAX_NAME)
        while start > floor and text[start - 1] in _NAME_CHARS:
            start -= 1
        while start < sign and not text[start].isalpha():  # "--hf_token=": the name is hf_token
            start += 1
        end = sign + 1
        if start < sign and is_secret_key(text[start:sign]):
            value_start, value_end = _pair_value(text, end)
            if value_end > value_start:
                parts.append(text[done:value_start])
                parts.append(REDACTED)
                done = value_end
                end = max(end, value_end)
        found = _NAMED_SIGN.search(text, end)
    if not parts:
        return text
    parts.append(text[done:])
    return "".join(parts)


def scrub_value(text: str) -> str:
    """``text`` with every credential it contains replaced by ``<redacted>`` (the rest kept)."""
    if _ANY.search(text) is None:
        return text
    for literals, pattern in _FORMATS:
        if any(literal in text for literal in literals):
            text = pattern.sub(_replace, text)
    if "=" in text:
        text = _scrub_pairs(text)
    if ":" in text and ('"' in text or "'" in text):
        for pattern in _QUOTED_PAIRS:
            text = pattern.sub(_redact_quoted_pair, text)
    return text


def scrub_text(text: str) -> str:
    """A message safe to print: credentials in URLs, ``name=value`` pairs and known formats removed."""
    return scrub_value(text)


# --- structures -------------------------------------------------------------------------------


def redact(value: Any) -> Any:
    """A copy of ``value`` with secret keys' values replaced and every string scrubbed.  Mappings
    (dicts, OmegaConf-like), lists, tuples and dataclasses are walked; numbers and other objects
    are returned as they are."""
    if isinstance(value, str):
        return scrub_value(value)
    if value is None or isinstance(value, (int, float, bool)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping) or _is_mapping_like(value):
        return {k: (REDACTED if is_secret_key(k) else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact(v) for v in value)
    return value


def scrub_strings(value: Any) -> Any:
    """``value`` with every string in it (in dicts, lists and tuples, however nested) scrubbed by
    value; keys are not looked at and other objects are returned as they are.  For ``log()``
    data: its keys name metrics and table columns, and its values must land as the ``log()``
    rules say (an array stays an array), credentials cut out."""
    if isinstance(value, str):
        return scrub_value(value)
    if isinstance(value, dict):
        return {k: scrub_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_strings(v) for v in value]
    if isinstance(value, tuple):
        return tuple(scrub_strings(v) for v in value)
    return value


def redact_config(config: Any) -> Any:
    """A copy of ``config`` with secrets replaced, by key and by value, in every shape a tracker
    accepts as a config: dicts and OmegaConf-like mappings, dataclasses, ``argparse.Namespace``,
    pydantic models (``model_dump()``), and any other object by its attributes (``vars()``), each
    made a dict, however nested; lists and tuples walked.  The caller's config is not modified."""
    shaped = _config_mapping(config)
    if shaped is not None:
        return {k: (REDACTED if is_secret_key(k) else redact_config(v)) for k, v in shaped.items()}
    if isinstance(config, list):
        return [redact_config(v) for v in config]
    if isinstance(config, tuple):
        return tuple(redact_config(v) for v in config)
    return redact(config)


def _config_mapping(value: Any) -> Mapping[Any, Any] | None:
    """The keys and values of a config-shaped object, or None for anything else (a string, a
    number, a list, a function, a class)."""
    if value is None or isinstance(value, (str, bytes, int, float, bool, list, tuple, type)):
        return None
    if isinstance(value, Mapping) or _is_mapping_like(value):
        return value
    if dataclasses.is_dataclass(value):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    model_dump = getattr(value, "model_dump", None)  # pydantic 2
    if callable(model_dump):
        dumped = model_dump()
        return dumped if isinstance(dumped, Mapping) else None
    if callable(value) or inspect.ismodule(value) or isinstance(value, enum.Enum):
        return None
    attributes = getattr(value, "__dict__", None)  # argparse.Namespace, SimpleNamespace, plain objects
    return attributes if isinstance(attributes, Mapping) else None


def _is_mapping_like(value: Any) -> bool:
    # OmegaConf DictConfig and similar: items() but not a Mapping subclass.
    return hasattr(value, "items") and hasattr(value, "keys") and not isinstance(value, (str, bytes))


def redact_header_values(names: Iterable[str]) -> str:
    names = list(names)
    if not names:
        return ""
    return " headers: " + ", ".join(f"{name}={REDACTED}" for name in names)


class ScrubFilter(logging.Filter):
    """Scrubs every record of the logger it is on: its message and its traceback (an exception's
    message often quotes a URL with credentials)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        scrubbed = scrub_text(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = scrub_text(logging.Formatter().formatException(record.exc_info))
        return True


def scrubbed_logger(name: str = "otel_tracking") -> logging.Logger:
    """``logging.getLogger(name)`` with a :class:`ScrubFilter` on it.  A logger's filters do not
    see its children's records: each logger of ours gets its own."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, ScrubFilter) for f in logger.filters):
        logger.addFilter(ScrubFilter())
    return logger


scrubbed_logger("otel_tracking")  # every module's logger (imported wherever a run is)
