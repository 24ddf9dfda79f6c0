"""The Required actions page and the hitlDetails API in-process: a response needs a login and the
session's CSRF token (form) or credentials (API), records who gave it, and a bad one is refused
in one line with nothing changed."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

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
    assert "responded yes" in local.get("/required_actions").text  # the flash


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
