"""The access log without credentials: a callback's token is its URL's last segment, and
uvicorn logs every request's path as it came, so the path of ``POST /api/v1/callbacks/{token}``
is logged with the token masked (whatever it is: a token cut or encoded is still a secret), and
every other path through the secrets masker."""

from __future__ import annotations

import logging
from urllib.parse import unquote

from deferral.runtime.secrets_masker import MASK, redact

# uvicorn's access logger, and the place of the path among its record's arguments
# ('%s - "%s %s HTTP/%s" %d': client, method, path with query, HTTP version, status).
ACCESS_LOGGER = "uvicorn.access"
_PATH_ARG = 2
CALLBACK_PATH = "/api/v1/callbacks/"


def masked_path(path: str) -> str:
    """``path`` (with its query) as the access log shows it."""
    # Routing matches the decoded path: /api/v1/%63allbacks/<token> reaches the callback too.
    if unquote(path).startswith(CALLBACK_PATH):
        return CALLBACK_PATH + MASK
    shown: str = redact(path)
    return shown


class MaskedPaths(logging.Filter):
    """Masks the path of each access log record (it never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > _PATH_ARG:
            path = args[_PATH_ARG]
            if isinstance(path, str):
                record.args = (*args[:_PATH_ARG], masked_path(path), *args[_PATH_ARG + 1 :])
        return True


def mask_access_log() -> None:
    """Mask the paths uvicorn's access log writes in this process (once, however often
    called)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, MaskedPaths) for f in logger.filters):
        logger.addFilter(MaskedPaths())
