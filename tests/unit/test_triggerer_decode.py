"""triggerer.decode: a deferral:triggers entry becomes a trigger, or is refused with a reason."""

from __future__ import annotations

import base64
import datetime as dt
import importlib
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.fernet import Fernet

from broker.replies import Entry
from broker.streams import TriggerMessage, TriggerSpec, to_fields
from deferral.runtime import serialization
from deferral.runtime.crypto import Cipher, Purpose
from deferral.triggers import BaseTrigger, DateTimeTrigger, FileTrigger, TriggerEvent
from triggerer import decode
from triggerer.decode import Decoded, RejectedEntry, decode_entry, load_trigger_class

KEY = Fernet.generate_key().decode()
OTHER_KEY = Fernet.generate_key().decode()
CIPHER = Cipher([KEY])
ALLOWED = ("deferral.triggers",)
HERE = __name__
MOMENT = dt.datetime(2030, 1, 1, 9, 30, tzinfo=dt.UTC)
DT_CLASSPATH = "deferral.triggers.temporal.DateTimeTrigger"


class NotATrigger:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class RaisingTrigger(BaseTrigger):
    def __init__(self, **kwargs: Any) -> None:
        raise ValueError("constructor refuses: bad host")

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{HERE}.RaisingTrigger", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(None)


def make_entry(
    *,
    trigger_id: int = 5,
    classpath: str = DT_CLASSPATH,
    kwargs: dict[str, Any] | None = None,
    cipher: Cipher = CIPHER,
    clear_trigger_id: str | None = None,
    clear_classpath: str | None = None,
    token: str | None = None,
    drop: str | None = None,
) -> Entry:
    spec = TriggerSpec(
        trigger_id=trigger_id,
        classpath=classpath,
        kwargs=serialization.check_kwargs(
            {"moment": MOMENT} if kwargs is None else kwargs, "trigger kwargs"
        ),
        task_instance_id=77,
        task="dag.run.task",
    )
    message = TriggerMessage(
        trigger_id=str(trigger_id) if clear_trigger_id is None else clear_trigger_id,
        classpath=classpath if clear_classpath is None else clear_classpath,
        task="dag.run.task",
        token=cipher.encrypt(Purpose.TRIGGER_SPEC, msgspec.json.encode(spec))
        if token is None
        else token,
    )
    fields = {k.encode(): v.encode() for k, v in to_fields(message).items()}
    if drop is not None:
        del fields[drop.encode()]
    return Entry("deferral:triggers", "1-0", fields)


def rejected(entry: Entry, prefixes: tuple[str, ...] = ALLOWED) -> RejectedEntry:
    with pytest.raises(RejectedEntry) as info:
        decode_entry(entry, CIPHER, prefixes)
    assert "\n" not in str(info.value)
    return info.value


# -- the valid case --------------------------------------------------------------------------------


def test_valid_entry_decodes_to_trigger_with_its_id() -> None:
    decoded = decode_entry(make_entry(), CIPHER, ALLOWED)
    assert isinstance(decoded, Decoded)
    assert isinstance(decoded.trigger, DateTimeTrigger)
    assert decoded.trigger.moment == MOMENT
    assert decoded.trigger.trigger_id == 5
    assert decoded.spec.trigger_id == 5
    assert decoded.spec.task_instance_id == 77
    assert decoded.spec.classpath == DT_CLASSPATH


def test_valid_entry_with_rotated_keys() -> None:
    entry = make_entry(cipher=Cipher([OTHER_KEY]))
    decoded = decode_entry(entry, Cipher([KEY, OTHER_KEY]), ALLOWED)
    assert decoded.trigger.trigger_id == 5


def test_kwargs_are_restored_from_tagged_form() -> None:
    entry = make_entry(
        classpath="deferral.triggers.file.FileTrigger",
        kwargs={"filepath": "/tmp/x", "poll_interval": 0.25},
    )
    trigger = decode_entry(entry, CIPHER, ALLOWED).trigger
    assert isinstance(trigger, FileTrigger)
    # Serialized before FileTrigger had ``recursive``: the default fills it in.
    assert trigger.serialize()[1] == {
        "filepath": "/tmp/x",
        "poll_interval": 0.25,
        "recursive": False,
    }


def test_trigger_class_from_another_allowed_prefix() -> None:
    entry = make_entry(classpath=f"{HERE}.RaisingTrigger", kwargs={})
    # Reaching the constructor proves the class was loaded from the second prefix.
    error = rejected(entry, ("deferral.triggers", "tests.unit"))
    assert "constructor raised" in str(error)


# -- rejections ------------------------------------------------------------------------------------


def test_token_from_another_key_is_rejected() -> None:
    error = rejected(make_entry(cipher=Cipher([OTHER_KEY])))
    assert "rejected trigger entry" in str(error)
    assert "token failed authentication" in str(error)
    assert error.trigger_id == 5


def test_corrupted_token_is_rejected() -> None:
    token = CIPHER.encrypt(Purpose.TRIGGER_SPEC, b"{}")
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[40] ^= 0xFF
    corrupted = base64.urlsafe_b64encode(bytes(raw)).decode()
    error = rejected(make_entry(token=corrupted, trigger_id=8))
    assert "token failed authentication" in str(error)
    assert error.trigger_id == 8


def test_garbage_token_is_rejected() -> None:
    error = rejected(make_entry(token="not-a-token"))
    assert error.trigger_id == 5


def test_non_ascii_token_is_rejected() -> None:
    error = rejected(make_entry(token="gAAAAAB-forgé"))
    assert error.trigger_id == 5


def test_authentic_token_that_is_not_a_trigger_spec_is_rejected() -> None:
    error = rejected(make_entry(token=CIPHER.encrypt(Purpose.TRIGGER_SPEC, b'{"hello": "world"}')))
    assert "rejected trigger entry" in str(error)
    assert error.trigger_id == 5


def test_authentic_token_that_is_not_json_is_rejected() -> None:
    error = rejected(make_entry(token=CIPHER.encrypt(Purpose.TRIGGER_SPEC, b"\x00\x01not json")))
    assert error.trigger_id == 5


def test_clear_trigger_id_disagreeing_with_token_is_rejected() -> None:
    error = rejected(make_entry(trigger_id=5, clear_trigger_id="6"))
    assert "fields disagree with its token" in str(error)
    assert error.trigger_id == 6


def test_clear_classpath_disagreeing_with_token_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = spy_imports(monkeypatch)
    error = rejected(make_entry(clear_classpath="deferral.triggers.file.FileTrigger"))
    assert "fields disagree with its token" in str(error)
    assert error.trigger_id == 5
    assert calls == []


def spy_imports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real: Callable[..., Any] = importlib.import_module

    def spy(name: str, package: str | None = None) -> Any:
        calls.append(name)
        return real(name, package)

    monkeypatch.setattr(decode.importlib, "import_module", spy)
    return calls


@pytest.mark.parametrize(
    "classpath",
    [
        "os.system",
        "subprocess.Popen",
        "deferral.triggersevil.Trigger",  # a prefix must match whole module names
        "deferral.Trigger",
        "Trigger",
        "builtins.eval",
    ],
)
def test_classpath_outside_allowed_prefixes_is_never_imported(
    classpath: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy_imports(monkeypatch)
    error = rejected(make_entry(classpath=classpath, kwargs={"command": "rm -rf /"}))
    assert str(error) == (
        f"rejected trigger 5: trigger class {classpath!r} is outside DEFERRAL_TRIGGER_MODULES"
    )
    assert error.trigger_id == 5
    assert calls == []


def test_class_that_is_not_a_base_trigger_is_rejected() -> None:
    error = rejected(make_entry(classpath=f"{HERE}.NotATrigger", kwargs={}), ("tests.unit",))
    assert f"'{HERE}.NotATrigger' is not a BaseTrigger subclass" in str(error)
    assert error.trigger_id == 5


@pytest.mark.parametrize(
    "classpath",
    [
        "deferral.triggers.base.classpath_of",  # a function
        "deferral.triggers.base.TriggerEvent",  # a class, but not a trigger
        "deferral.triggers.temporal.NoSuchClass",
        "deferral.triggers.temporal.dt",  # a module attribute
    ],
)
def test_non_trigger_attributes_are_rejected(classpath: str) -> None:
    error = rejected(make_entry(classpath=classpath, kwargs={}))
    assert "is not a BaseTrigger subclass" in str(error)


def test_unimportable_module_is_rejected_naming_it() -> None:
    error = rejected(make_entry(classpath="deferral.triggers.no_such_module.T", kwargs={}))
    assert "cannot import 'deferral.triggers.no_such_module'" in str(error)
    assert "ModuleNotFoundError" in str(error)
    assert error.trigger_id == 5


def test_constructor_that_raises_is_rejected_naming_exception() -> None:
    error = rejected(make_entry(classpath=f"{HERE}.RaisingTrigger", kwargs={}), ("tests.unit",))
    assert str(error) == (
        f"trigger 5 ({HERE}.RaisingTrigger) constructor raised "
        "ValueError: constructor refuses: bad host"
    )
    assert error.trigger_id == 5


def test_constructor_given_wrong_kwargs_is_rejected() -> None:
    error = rejected(make_entry(kwargs={"moment": "2030-01-01"}))
    assert "constructor raised TypeError" in str(error)
    error = rejected(make_entry(kwargs={"when": MOMENT}))
    assert "constructor raised TypeError" in str(error)


def test_abstract_base_trigger_is_rejected() -> None:
    error = rejected(make_entry(classpath="deferral.triggers.base.BaseTrigger", kwargs={}))
    assert "constructor raised TypeError" in str(error)


def test_malformed_kwargs_tag_is_rejected() -> None:
    spec = {
        "trigger_id": 5,
        "classpath": DT_CLASSPATH,
        "kwargs": {"moment": {serialization.TAG: "alien"}},
        "task_instance_id": 1,
        "task": "d.r.t",
    }
    error = rejected(
        make_entry(token=CIPHER.encrypt(Purpose.TRIGGER_SPEC, msgspec.json.encode(spec)))
    )
    assert "rejected trigger 5" in str(error)
    assert "alien" in str(error)


@pytest.mark.parametrize("field", ["token", "classpath", "task"])
def test_missing_field_is_rejected_keeping_clear_trigger_id(field: str) -> None:
    error = rejected(make_entry(drop=field))
    assert "malformed TriggerMessage" in str(error)
    assert error.trigger_id == 5


def test_entry_without_usable_trigger_id_has_none() -> None:
    assert rejected(make_entry(drop="trigger_id")).trigger_id is None
    error = rejected(make_entry(clear_trigger_id="five", token="garbage"))
    assert error.trigger_id is None


def test_empty_entry_is_rejected() -> None:
    error = rejected(Entry("deferral:triggers", "1-0", {}))
    assert error.trigger_id is None


# -- helpers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        ("deferral.triggers", True),
        ("deferral.triggers.temporal", True),
        ("deferral.triggers_extra", False),
        ("deferral", False),
        ("mycompany.deferral.triggers", False),
    ],
)
def test_module_allowed(module: str, allowed: bool) -> None:
    assert decode.module_allowed(module, ["deferral.triggers"]) is allowed


def test_load_trigger_class() -> None:
    assert load_trigger_class(DT_CLASSPATH, ALLOWED) is DateTimeTrigger
    with pytest.raises(ValueError, match="outside DEFERRAL_TRIGGER_MODULES"):
        load_trigger_class(DT_CLASSPATH, ())


def test_an_unexpected_error_is_a_rejection_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(classpath: str, prefixes: Any) -> type[BaseTrigger]:
        raise RuntimeError("importer exploded")

    monkeypatch.setattr(decode, "load_trigger_class", broken)
    error = rejected(make_entry(trigger_id=9))
    assert str(error) == "rejected trigger entry: RuntimeError: importer exploded"
    assert error.trigger_id == 9


def test_a_trigger_class_is_loaded_again_once_its_module_was_run_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Classes are kept per classpath (a takeover builds a thousand of one class), but not past
    the module they came from: a DAGs-folder module run afresh gives its new class."""
    (tmp_path / "fresh_triggers.py").write_text(
        "from deferral.triggers.base import BaseTrigger\nclass T(BaseTrigger):\n    version = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    first = load_trigger_class("fresh_triggers.T", ["fresh_triggers"])
    assert load_trigger_class("fresh_triggers.T", ["fresh_triggers"]) is first
    (tmp_path / "fresh_triggers.py").write_text(
        "from deferral.triggers.base import BaseTrigger\nclass T(BaseTrigger):\n    version = 2\n"
    )
    monkeypatch.delitem(sys.modules, "fresh_triggers")
    importlib.invalidate_caches()
    again = load_trigger_class("fresh_triggers.T", ["fresh_triggers"])
    assert again is not first and again.version == 2  # type: ignore[attr-defined]
