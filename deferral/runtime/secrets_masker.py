"""Masks secrets in what deferral records and shows (rendered template fields, command output),
as Airflow's secrets masker does.

A value is a secret when it is a Connection's password, or the value of a Variable, or of a key
in a Connection's extra, whose name contains one of ``SENSITIVE_FIELDS``. Each is registered
with ``mask_secret`` when it is read, and ``redact`` then replaces every occurrence of it with
``***``. The registry lives as long as the process, like Airflow's: a secret read while a DAG file
was parsed is still masked in the tries that process runs later.

As in Airflow 2.10, a secret shorter than ``MIN_MASKED_LENGTH`` is not searched for inside other
text (a one-letter password would mask that letter everywhere); a value that is exactly such a
secret is still masked.

A secret made by deferral with a shape of its own (a callback token) is registered once as that
shape (``mask_shape``) and masked by every masker of every process: the process showing it (the
web server, the CLI) never saw it made, and one entry per secret made would grow for ever in a
task process that runs thousands of attempts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

MASK = "***"
MIN_MASKED_LENGTH = 5

# Airflow's DEFAULT_SENSITIVE_FIELDS: a name containing any of these is sensitive.
SENSITIVE_FIELDS = frozenset(
    {
        "access_token",
        "api_key",
        "apikey",
        "authorization",
        "passphrase",
        "passwd",
        "password",
        "private_key",
        "secret",
        "token",
        "keyfile_dict",
        "service_account",
    }
)


def should_hide_value_for_key(name: object) -> bool:
    """Whether a Variable key, extra key or field name marks its value as a secret."""
    if not isinstance(name, str):
        return False
    lowered = name.strip().lower()
    return any(field in lowered for field in SENSITIVE_FIELDS)


# Shapes every masker masks (see the module's docstring): pattern -> (its anchor, itself).
_shapes: dict[str, tuple[re.Pattern[str], re.Pattern[str]]] = {}


def mask_shape(pattern: str, anchor: str) -> None:
    """Mask every match of the regular expression ``pattern`` from now on, in every masker of
    this process (``mask_with_kwargs``' too). ``anchor`` is a pattern every match contains,
    starting with a literal character: text is searched for it first, which is much quicker
    than for the shape (the regex engine skips to a literal), and most text has none."""
    _shapes.setdefault(pattern, (re.compile(anchor), re.compile(pattern)))


# What deferral.store.callback_tokens.make_token makes (<ti>.<try>.<expires>.<nonce>.<mac>, the
# MAC 43 base64url characters), wherever it stands: alone, at the end of a URL, inside JSON or a
# sentence; and the part of it text is searched for first. Registered here, with the maskers
# themselves, so a process masks it whatever else it imported.
CALLBACK_TOKEN_SHAPE = (
    r"(?<![A-Za-z0-9_-])[0-9]{1,19}\.[0-9]{1,19}\.[0-9]{1,19}\.[A-Za-z0-9_-]{1,64}"
    r"\.[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"
)
CALLBACK_TOKEN_ANCHOR = r"\.[A-Za-z0-9_-]{43}"
mask_shape(CALLBACK_TOKEN_SHAPE, CALLBACK_TOKEN_ANCHOR)


def _mask_shapes(text: str) -> str:
    for anchor, shape in _shapes.values():
        if anchor.search(text):
            text = shape.sub(MASK, text)
    return text


class SecretsMasker:
    def __init__(self) -> None:
        self._secrets: set[str] = set()
        self._short: set[str] = set()  # masked only when a value is exactly one of them
        self._replacer: re.Pattern[str] | None = None

    def add_mask(self, secret: Any, name: str | None = None) -> None:
        """Register ``secret`` (a string, or the strings inside a dict or list); with a ``name``
        only if that name is sensitive. Inside a dict, each key names its own value."""
        if isinstance(secret, Mapping):
            for key, value in secret.items():
                self.add_mask(value, key)
        elif isinstance(secret, str):
            wanted = name is None or should_hide_value_for_key(name)
            if secret and wanted and len(secret) < MIN_MASKED_LENGTH:
                self._short.add(secret)
            elif secret and wanted and secret not in self._secrets:
                self._secrets.add(secret)
                # Longest first: a secret that contains another is masked whole.
                ordered = sorted(self._secrets, key=len, reverse=True)
                self._replacer = re.compile("|".join(re.escape(s) for s in ordered))
        elif isinstance(secret, Iterable):
            for item in secret:
                self.add_mask(item, name)

    def redact(self, value: Any, name: str | None = None) -> Any:
        """A copy of ``value`` with registered secrets masked in its strings; everything under a
        sensitive name (``name``, or a dict key) is masked whole."""
        if name is not None and should_hide_value_for_key(name):
            return _mask_all(value)
        if isinstance(value, str):
            if value in self._short:
                return MASK
            return _mask_shapes(self._replacer.sub(MASK, value) if self._replacer else value)
        if isinstance(value, Mapping):
            return {key: self.redact(item, key) for key, item in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return type(value)(self.redact(item) for item in value)
        return value


def _mask_all(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {key: _mask_all(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_mask_all(item) for item in value]
    return MASK


_masker = SecretsMasker()


def mask_secret(secret: Any, name: str | None = None) -> None:
    """Mask ``secret`` from now on in this process (see SecretsMasker.add_mask)."""
    _masker.add_mask(secret, name)


def redact(value: Any, name: str | None = None) -> Any:
    """``value`` with every secret registered in this process masked."""
    return _masker.redact(value, name)


# -- the secrets a trigger was given -----------------------------------------------------------


def _url_secrets(text: str) -> list[str]:
    """What a URL in ``text`` may carry in secret: its user info (and the password alone, as
    given and decoded), its query string and each value in it."""
    try:
        parts = urlsplit(text)
    except ValueError:
        return []
    if not parts.scheme or not parts.netloc:
        return []
    found: list[str] = []
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and userinfo:
        found.append(userinfo)
        _, colon, password = userinfo.partition(":")
        if colon and password:
            found += [password, unquote(password)]
    if parts.query:
        found.append(parts.query)
        for _, value in parse_qsl(parts.query, keep_blank_values=False):
            found += [value, quote(value, safe="")]
    return found


def secrets_in_kwargs(kwargs: Any, name: str | None = None) -> set[str]:
    """The secrets in a trigger's kwargs: every string under a sensitive name (``password``,
    ``api_key``...), and the user info and query string of every URL, at any depth."""
    found: set[str] = set()
    if isinstance(kwargs, Mapping):
        for key, value in kwargs.items():
            found |= secrets_in_kwargs(value, key if should_hide_value_for_key(key) else name)
    elif isinstance(kwargs, str):
        if name is not None:
            found.add(kwargs)
        found.update(_url_secrets(kwargs))
    elif isinstance(kwargs, (list, tuple, set, frozenset)):
        for item in kwargs:
            found |= secrets_in_kwargs(item, name)
    return {secret for secret in found if secret}


def mask_with_kwargs(value: Any, kwargs: Any) -> Any:
    """``value`` (an event payload, a failure) with the secrets of a trigger's kwargs masked."""
    masker = SecretsMasker()
    for secret in secrets_in_kwargs(kwargs):
        masker.add_mask(secret)
    return masker.redact(value)
