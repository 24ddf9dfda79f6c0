"""The Streams page's dead-letter actions: retry and drop behind a login and the session's CSRF
token, on the paths of `deferral dead retry|drop`."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker.client import Broker
from broker.streams import GROUP_TRIGGERERS
from deferral.runtime.crypto import Cipher
from tests.integration.factories import deferred_task
from tests.integration.test_dead_letters import dead_letter_via_consumer, publish_trigger
from tests.integration.test_webserver import csrf_of, log_in


@pytest.fixture
def dead_id(sessions: sessionmaker[Session], cipher: Cipher, broker: Broker) -> str:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    publish_trigger(broker, cipher, ti_id, trigger_id)
    return dead_letter_via_consumer(
        broker, cipher, broker.keys.triggers, GROUP_TRIGGERERS, "injected transient fault"
    )


def test_the_streams_page_retries_and_drops_dead_letters_with_login_and_csrf(
    request: pytest.FixtureRequest, dead_id: str, broker: Broker
) -> None:
    ui: TestClient = request.getfixturevalue("exposed")
    retry = {"dead_id": dead_id, "action": "retry"}
    # Not logged in, no token: refused, nothing changes.
    refused = ui.post("/streams/dead", data=retry)
    assert refused.status_code == 403
    assert log_in(ui).status_code == 303
    page = ui.get("/streams")
    assert page.status_code == 200
    assert re.search(rf'name="dead_id" value="{dead_id}"', page.text)
    assert "injected transient fault" in page.text
    # Logged in, still no token (a form posted from another site): refused.
    assert ui.post("/streams/dead", data=retry).status_code == 403
    assert ui.post("/streams/dead", data={**retry, "csrf_token": "forged"}).status_code == 403
    assert broker.redis.xlen(broker.keys.dead) == 1
    assert broker.redis.xlen(broker.keys.triggers) == 0

    token = csrf_of(ui, "/streams")
    done = ui.post("/streams/dead", data={**retry, "csrf_token": token})
    assert (done.status_code, done.headers["location"]) == (303, "/streams")
    (entry,) = broker.xrange(broker.keys.triggers)
    assert broker.redis.xlen(broker.keys.dead) == 0
    assert f"retried {dead_id}: now {broker.keys.triggers} {entry.id}" in ui.get("/streams").text

    again = ui.post("/streams/dead", data={**retry, "csrf_token": token})
    assert again.status_code == 303
    assert "no dead letter" in ui.get("/streams").text
    assert len(broker.xrange(broker.keys.triggers)) == 1

    dropped = ui.post(
        "/streams/dead", data={"dead_id": dead_id, "action": "drop", "csrf_token": token}
    )
    assert dropped.status_code == 303
    bad = ui.post("/streams/dead", data={"dead_id": "<x>", "action": "retry", "csrf_token": token})
    assert bad.status_code == 400 and "is not a dead letter id" in bad.text
    assert "&lt;x&gt;" in bad.text  # escaped
