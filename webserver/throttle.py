"""Backoff for password guesses, per client address and per user name, on the login form and on
HTTP Basic credentials alike.

Each key (a client address, a user name) may fail a few times freely; every further failure
closes it for twice as long as the one before, up to a cap. While a key is closed, attempts are
refused without checking the password (no argon2 work) and do not count: backoff, not lockout,
so a guesser cannot lock a user out for longer than the cap. A success forgets the user name's
failures (never the client's: one account of one's own must not reset the guessing of others).
Pure: the clock is passed in, so the tests move it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Failures a client address, or a user name, may make before each further one closes it.
FREE_FAILURES_PER_CLIENT = 5
FREE_FAILURES_PER_USER = 10
# The first closing lasts this long; each further failure doubles it, up to the cap.
FIRST_BACKOFF_SEC = 1.0
MAX_BACKOFF_SEC = 300.0
# A key's failures are forgotten this long after its last one.
FORGET_AFTER_SEC = 900.0
# Keys remembered at most (the oldest are forgotten first): memory stays bounded whatever
# addresses and names a guesser sends.
MAX_KEYS = 10_000
# A user name is keyed by its first characters (a valid one is at most 64).
USER_KEY_CHARS = 64


@dataclass
class _Failures:
    count: int
    last_at: float
    closed_until: float


def backoff_sec(failures: int, free: int) -> float:
    """How long a key closes after its ``failures``-th failure (0 while within ``free``)."""
    beyond = failures - free
    if beyond <= 0:
        return 0.0
    return min(MAX_BACKOFF_SEC, FIRST_BACKOFF_SEC * 2.0 ** min(beyond - 1, 32))


class LoginThrottle:
    def __init__(self) -> None:
        self._keys: OrderedDict[tuple[str, str], _Failures] = OrderedDict()

    @staticmethod
    def _keys_of(client: str, username: str) -> list[tuple[tuple[str, str], int]]:
        return [
            (("client", client), FREE_FAILURES_PER_CLIENT),
            (("user", username[:USER_KEY_CHARS]), FREE_FAILURES_PER_USER),
        ]

    def _current(self, key: tuple[str, str], now: float) -> _Failures | None:
        found = self._keys.get(key)
        if found is not None and now - found.last_at >= FORGET_AFTER_SEC:
            del self._keys[key]
            return None
        return found

    def wait_sec(self, client: str, username: str, now: float) -> float:
        """Seconds until an attempt from ``client`` as ``username`` may be checked (0: now)."""
        waits = [0.0]
        for key, _ in self._keys_of(client, username):
            found = self._current(key, now)
            if found is not None:
                waits.append(found.closed_until - now)
        return max(waits)

    def failed(self, client: str, username: str, now: float) -> None:
        for key, free in self._keys_of(client, username):
            found = self._current(key, now)
            count = 1 if found is None else found.count + 1
            self._keys[key] = _Failures(count, now, now + backoff_sec(count, free))
            self._keys.move_to_end(key)
        while len(self._keys) > MAX_KEYS:
            self._keys.popitem(last=False)

    def succeeded(self, username: str) -> None:
        self._keys.pop(("user", username[:USER_KEY_CHARS]), None)
