"""What a triggerer runs for an asset watcher comes from the sealed token only: a forged token,
a class outside DEFERRAL_TRIGGER_MODULES or one that is not an event trigger is refused in one
line naming it."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from cryptography.fernet import Fernet

from deferral.runtime.crypto import Cipher, Purpose
from deferral.triggers.event import DirectoryWatchTrigger
from deferral.triggers.temporal import DateTimeTrigger
from triggerer.watchers import open_watcher

CIPHER = Cipher([Fernet.generate_key().decode()])
MODULES = ["deferral.triggers"]


def seal(trigger: Any) -> str:
    classpath, kwargs = trigger.serialize()
    return CIPHER.seal(Purpose.WATCHER_SPEC, {"classpath": classpath, "kwargs": kwargs})


def test_a_sealed_event_trigger_is_rebuilt() -> None:
    trigger = open_watcher(seal(DirectoryWatchTrigger("/tmp", "*.csv")), CIPHER, MODULES)
    assert isinstance(trigger, DirectoryWatchTrigger) and trigger.pattern == "*.csv"


@pytest.mark.parametrize(
    ("token", "modules", "message"),
    [
        ("forged", MODULES, "watcher token refused"),
        (seal(DirectoryWatchTrigger("/tmp")), ["elsewhere"], "outside DEFERRAL_TRIGGER_MODULES"),
        (
            seal(DateTimeTrigger(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))),
            MODULES,
            "DateTimeTrigger is not an event trigger",
        ),
    ],
)
def test_a_bad_watcher_is_refused_naming_why(token: str, modules: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        open_watcher(token, CIPHER, modules)
    assert "\n" not in str(refused.value)
