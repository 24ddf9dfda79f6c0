"""Callback tokens are never shown: every masker of every process masks a token's shape, so a
task gets the real URL while what is recorded of it (rendered fields, log lines) reads ``***``;
the access log masks a callback's path."""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import sys

import pytest
from cryptography.fernet import Fernet

from deferral import DAG
from deferral.authoring.templating import render_template_fields, rendered_fields
from deferral.runtime.crypto import Cipher
from deferral.runtime.secrets_masker import MASK, SecretsMasker, mask_with_kwargs, redact
from deferral.store.callback_tokens import make_token, read_token
from deferral.store.metastore import metastore
from tests.unit.test_templating import Templated, _no_database, context_for
from webserver.access_log import ACCESS_LOGGER, MaskedPaths, mask_access_log, masked_path

__all__ = ["_no_database"]  # the module's fixture: no database, a Fernet key of its own

CIPHER = Cipher([Fernet.generate_key().decode()])


def _tokens(count: int) -> list[str]:
    now = dt.datetime.now(dt.UTC)
    return [make_token(CIPHER, 10**i, i % 3 + 1, now) for i in range(count)]


# Ids by position: the tokens are random, and every xdist lane must collect the same ids.
@pytest.mark.parametrize("token", _tokens(12), ids=[f"token{i}" for i in range(12)])
def test_a_token_is_masked_wherever_it_stands_by_every_masker(token: str) -> None:
    places = [
        token,
        f"http://localhost:8080/api/v1/callbacks/{token}",
        json.dumps({"url": f"https://example.com/api/v1/callbacks/{token}"}),
        f"curl -X POST https://h/api/v1/callbacks/{token}.",
        f"job --callback={token}?x=1",
    ]
    for text in places:
        for masked in (redact(text), SecretsMasker().redact(text), mask_with_kwargs(text, {})):
            assert token not in masked and MASK in masked, masked
    assert redact({"cb": places[1]}) == {"cb": "http://localhost:8080/api/v1/callbacks/***"}


@pytest.mark.parametrize(
    "text",
    [
        "version 10.0.1.2",
        "10.0.0.1:8080",
        "1.2.3.abc." + "A" * 42,  # a MAC one character short is no token
        "1.2.3.abc." + "A" * 44,
        "x1.2.3.abc." + "A" * 43,  # inside a longer word
        "a.b.c.d.e",
    ],
)
def test_what_only_resembles_a_token_is_left_alone(text: str) -> None:
    assert redact(text) == text


def test_every_process_masks_tokens_from_its_first_import_of_deferral() -> None:
    """The web server and the CLI never made the tokens they might show."""
    token = _tokens(1)[0]
    code = (
        "import sys; from deferral.runtime.secrets_masker import redact; print(redact(sys.argv[1]))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code, f"see /api/v1/callbacks/{token}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown == "see /api/v1/callbacks/***\n"


def test_the_task_gets_the_real_url_and_the_recorded_fields_are_masked() -> None:
    task = Templated(
        task_id="t",
        text="curl -X POST {{ callback.url }}",
        data={"token": "{{ callback.token }}", "job": ["--notify", "{{ callback.url }}"]},
        dag=DAG("tokens"),
    )
    context = context_for(task)
    render_template_fields(task, context)
    token = context["callback"].token
    claim = read_token(metastore().cipher, token, dt.datetime.now(dt.UTC))
    assert (claim.task_instance_id, claim.try_number) == (9, 2)
    assert task.text == f"curl -X POST http://localhost:8080/api/v1/callbacks/{token}"
    assert task.data["token"] == token

    recorded = rendered_fields(task)
    assert token not in json.dumps(recorded)
    assert recorded == {
        "text": "curl -X POST http://localhost:8080/api/v1/callbacks/***",
        "data": {"token": MASK, "job": ["--notify", "http://localhost:8080/api/v1/callbacks/***"]},
    }


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/callbacks/{token}",
        "/api/v1/callbacks/{token}?status=success",
        "/api/v1/%63allbacks/{token}",  # routing decodes the path: this reaches the callback too
        "/api/v1/callbacks/not-even-a-token",
    ],
)
def test_the_access_log_masks_a_callbacks_path(path: str) -> None:
    token = _tokens(1)[0]
    record = logging.LogRecord(
        ACCESS_LOGGER,
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "POST", path.format(token=token), "1.1", 409),
        None,
    )
    assert MaskedPaths().filter(record)
    assert record.getMessage() == '127.0.0.1:5000 - "POST /api/v1/callbacks/*** HTTP/1.1" 409'


def test_other_paths_are_logged_as_they_came_unless_they_hold_a_token() -> None:
    token = _tokens(1)[0]
    assert masked_path("/dags/x/task_instance?run_id=r1") == "/dags/x/task_instance?run_id=r1"
    assert masked_path(f"/dags?q={token}") == "/dags?q=***"


def test_the_access_log_filter_is_installed_once() -> None:
    logger = logging.getLogger(ACCESS_LOGGER)
    before = list(logger.filters)
    try:
        mask_access_log()
        mask_access_log()
        assert sum(isinstance(f, MaskedPaths) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before
