"""The Required actions page and the hitlDetails API in-process: a response needs a login and the
session's CSRF token (form) or credentials (API), records who gave it, and a bad one is refused
in one line with nothing changed."""

from __future__ import annotations

import datetime as dt

from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from deferral.models.param import Param
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import TaskState
from deferral.store.tables import HITLDetail, TaskInstance
from tests.integration.factories import awaiting_input_task
from tests.integration.test_webserver import ADMIN_PASSWORD, basic, csrf_of, log_in


def _detail(sessions: sessionmaker[Session], ti_id: int) -> tuple[str, HITLDetail]:
    with sessions() as session:
        ti, detail = session.get(TaskInstance, ti_id), session.get(HITLDetail, ti_id)
        assert ti is not None and detail is not None
        return ti.state, detail


def test_the_form_needs_a_login_and_its_csrf_token(
    local: TestClient, sessions: sessionmaker[Session]
) -> None:
    ti_id = awaiting_input_task(sessions, "asks", "r1")
    page = local.get("/required_actions")  # open reads on loopback
    assert page.status_code == 200 and "ok?" in page.text and "Log in</a> to respond" in page.text
    # Its time as every page shows one, not the API's ISO string.
    with sessions() as session:
        asked = session.get(HITLDetail, ti_id)
        assert asked is not None
        shown = asked.created_at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert f"· asked {shown}" in page.text and asked.created_at.isoformat() not in page.text
    token = csrf_of(local)
    refused = local.post(
        f"/required_actions/{ti_id}/respond", data={"chosen_options": "yes", "csrf_token": token}
    )
    assert refused.status_code == 303 and refused.headers["location"].startswith("/login")
    log_in(local)
    forged = local.post(
        f"/required_actions/{ti_id}/respond", data={"chosen_options": "yes", "csrf_token": "x"}
    )
    assert forged.status_code == 403
    assert _detail(sessions, ti_id)[0] == TaskState.AWAITING_INPUT
    token = csrf_of(local, "/required_actions")
    done = local.post(
        f"/required_actions/{ti_id}/respond", data={"chosen_options": "yes", "csrf_token": token}
    )
    assert done.status_code == 303
    state, detail = _detail(sessions, ti_id)
    assert state == TaskState.SCHEDULED and detail.responded_by == "admin"
    answered = local.get("/required_actions").text
    assert "responded yes" in answered  # the flash
    assert detail.responded_at is not None
    assert detail.responded_at.astimezone(dt.UTC).strftime("%H:%M:%S UTC</td>") in answered


def test_the_api_needs_credentials_and_refuses_bad_responses_in_one_line(
    local: TestClient, sessions: sessionmaker[Session]
) -> None:
    ti_id = awaiting_input_task(sessions, "asks", "r2")
    path = f"/api/v1/hitlDetails/{ti_id}"
    assert local.post(path, json={"chosen_options": ["yes"]}).status_code == 401
    auth = basic("admin", ADMIN_PASSWORD)
    for body, status, said in (
        ({"chosen_options": "yes"}, 400, "chosen_options must be a list of options"),
        ({"chosen_options": ["nope"]}, 400, "unknown option 'nope'"),
        ({"chosen_options": ["yes"], "params_input": [1]}, 400, "params_input must be a JSON"),
    ):
        answer = local.post(path, json=body, headers=auth)
        assert answer.status_code == status and said in answer.json()["error"]
    unknown = local.post(
        "/api/v1/hitlDetails/999999", json={"chosen_options": ["yes"]}, headers=auth
    )
    assert unknown.status_code == 404
    assert _detail(sessions, ti_id)[0] == TaskState.AWAITING_INPUT
    assert local.post(path, json={"chosen_options": ["yes"]}, headers=auth).status_code == 200
    again = local.post(path, json={"chosen_options": ["no"]}, headers=auth)
    assert again.status_code == 409 and "already responded to by admin" in again.json()["error"]
    listed = local.get("/api/v1/hitlDetails?state=all", headers=auth).json()
    assert [(d["task_instance_id"], d["chosen_options"]) for d in listed["hitl_details"]] == [
        (ti_id, ["yes"])
    ]


# -- secret-looking params ---------------------------------------------------------------------

PASSWORD = "hunter2-canary-7c1d"
API_KEY = "k3y-canary-0b9e"
PARAMS = {
    "password": Param(PASSWORD, "the database's").dump(),
    "api_key": Param(API_KEY, type="string").dump(),
    "region": Param("eu-west", type="string").dump(),
    "retries": Param(3, type="integer").dump(),
}


def test_secret_looking_param_defaults_are_masked_in_the_api_and_the_form(
    local: TestClient, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """As the trigger form masks a DAG's: anonymous readers (loopback) see `***` for a
    secret-looking param's default, the form shows it masked, and a masked field posted as it
    was means the default, not the text `***`."""
    ti_id = awaiting_input_task(sessions, "asks", "r3", params=PARAMS)
    listed = local.get("/api/v1/hitlDetails")
    page = local.get("/required_actions")
    for answer in (listed, page):
        assert answer.status_code == 200
        assert PASSWORD not in answer.text and API_KEY not in answer.text
    (shown,) = listed.json()["hitl_details"]
    assert {name: spec["value"] for name, spec in shown["params"].items()} == {
        "password": "***",
        "api_key": "***",
        "region": "eu-west",
        "retries": 3,
    }
    assert shown["params"]["password"]["description"] == "the database's"

    log_in(local)
    form = local.get("/required_actions").text
    assert PASSWORD not in form and API_KEY not in form
    assert 'name="param:password" type="text" value="***"' in form
    assert 'name="param:region" type="text" value="eu-west"' in form
    token = csrf_of(local, "/required_actions")
    posted = {
        "chosen_options": "yes",
        "csrf_token": token,
        "param:password": "***",  # left as shown
        "param:api_key": "a-new-key-given",
        "param:region": "eu-west",
        "param:retries": "5",
    }
    assert local.post(f"/required_actions/{ti_id}/respond", data=posted).status_code == 303
    assert _detail(sessions, ti_id)[0] == TaskState.SCHEDULED
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None and ti.next_event is not None
        event = cipher.open(Purpose.EVENT, ti.next_event)
    assert event["params_input"] == {
        "password": PASSWORD,  # the default, not "***"
        "api_key": "a-new-key-given",
        "region": "eu-west",
        "retries": 5,
    }
    answered = local.get("/api/v1/hitlDetails?state=all").json()["hitl_details"][0]
    assert answered["params_input"] == {
        "password": "***",
        "api_key": "***",
        "region": "eu-west",
        "retries": 5,
    }
    later = local.get("/api/v1/hitlDetails?state=all").text + local.get("/required_actions").text
    assert PASSWORD not in later and "a-new-key-given" not in later


def test_the_apis_answer_masks_the_secret_looking_params_it_applied(
    local: TestClient, sessions: sessionmaker[Session]
) -> None:
    ti_id = awaiting_input_task(sessions, "asks", "r4", params=PARAMS)
    answer = local.post(
        f"/api/v1/hitlDetails/{ti_id}",
        json={"chosen_options": ["yes"], "params_input": {"region": "us"}},
        headers=basic("admin", ADMIN_PASSWORD),
    )
    assert answer.status_code == 200 and PASSWORD not in answer.text
    assert answer.json()["params_input"] == {
        "password": "***",
        "api_key": "***",
        "region": "us",
        "retries": 3,
    }


def test_a_form_value_that_is_not_its_params_kind_is_refused_in_one_line(
    local: TestClient, sessions: sessionmaker[Session]
) -> None:
    ti_id = awaiting_input_task(sessions, "asks", "r5", params=PARAMS)
    log_in(local)
    token = csrf_of(local, "/required_actions")
    posted = {"chosen_options": "yes", "csrf_token": token, "param:retries": "many"}
    done = local.post(f"/required_actions/{ti_id}/respond", data=posted)
    assert done.status_code == 303
    assert (
        "param &#39;retries&#39;: &#39;many&#39; is not a valid integer"
        in local.get("/required_actions").text
    )
    assert _detail(sessions, ti_id)[0] == TaskState.AWAITING_INPUT
