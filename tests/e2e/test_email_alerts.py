"""email_on_retry / email_on_failure through the real processes and a real SMTP server: the
worker mails once the failure is committed, as Airflow words its alert; a task whose flag is
off sends nothing; a mail server that refuses the login costs no task its outcome and is
logged in one line without the password."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import tasklogs
from deferral.store.tables import TaskInstance
from tests.e2e.conftest import Services
from tests.helpers import wait_for
from tests.smtp import SMTP_PASSWORD, smtp_server

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:Requiring AUTH:UserWarning")]

# Written as Airflow's tutorial writes its default_args.
DAG = """
import datetime as dt

from deferral import DAG
from deferral.operators.bash import BashOperator
from deferral.operators.python import PythonOperator


def fails():
    raise ValueError("the <upstream> table is empty")


with DAG(
    "e2e_email",
    default_args={
        "email": ["ops@example.com", "oncall@example.com"],
        "email_on_failure": True,
        "email_on_retry": True,
        "retries": 1,
        "retry_delay": dt.timedelta(seconds=0),
    },
) as dag:
    PythonOperator(task_id="flaky", python_callable=fails)
    BashOperator(
        task_id="quiet",
        bash_command='echo "password: $DEFERRAL_SMTP_PASSWORD"; exit 3',
        email_on_failure=False,
        retries=0,
    )
"""


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        rows = session.execute(select(TaskInstance.task_id, TaskInstance.state)).all()
    return {task_id: state for task_id, state in rows}


def _run_to_failure(
    services: Services, sessions: sessionmaker[Session], env: dict[str, str]
) -> None:
    """Start the services with ``env`` and run the DAG until both its tasks failed."""
    services.env.update(env)
    services.start("scheduler")
    services.start("worker")
    assert services.run("dags", "trigger", "e2e_email").returncode == 0
    wait_for(
        lambda: _states(sessions) == {"flaky": "failed", "quiet": "failed"},
        timeout=120,
        what="both tasks failed",
    )


def test_alerts_on_retry_and_on_failure(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_email_dag", DAG)
    with smtp_server() as mailbox:
        _run_to_failure(services, sessions, mailbox.env())
        wait_for(lambda: len(mailbox.messages) >= 2, timeout=60, what="two alerts")
        services.stop_all()  # a stopping worker sends what it queued first

    subjects = sorted(str(message["Subject"]) for message in mailbox.messages)
    assert len(mailbox.messages) == 2, subjects  # nothing for "quiet"
    run_id = subjects[0].split()[-2]
    assert subjects == [
        f"deferral alert: <TaskInstance: e2e_email.flaky {run_id} [failed]>",
        f"deferral alert: <TaskInstance: e2e_email.flaky {run_id} [up_for_retry]>",
    ]
    assert mailbox.recipients == [["ops@example.com", "oncall@example.com"]] * 2
    assert set(mailbox.logins) == {"alerts"}
    by_state = {str(m["Subject"]).rsplit("[", 1)[1].rstrip("]>"): m for m in mailbox.messages}
    retry = by_state["up_for_retry"]
    assert retry["From"] == "deferral@example.com"
    body = retry.get_body(("html",))
    assert body is not None
    content = body.get_content()
    assert content.startswith("Try 1 out of 2<br>Exception:<br>")
    # The error is escaped, as Airflow's autoescaped template does.
    assert "ValueError: the &lt;upstream&gt; table is empty<br>" in content
    assert f"Log: deferral tasks logs e2e_email {run_id} flaky --try 1<br>" in content
    assert "Try 2 out of 2<br>" in by_state["failed"].get_body(("html",)).get_content()
    assert "email alert for e2e_email" in services.log("worker")
    # The task's log masks the SMTP password, as every secret the task process knows.
    with sessions() as session:
        quiet = session.scalars(select(TaskInstance).where(TaskInstance.task_id == "quiet")).one()
        lines = [line.text for line in tasklogs.read_lines(session, quiet.id, 1)]
    assert "password: ***" in lines and not any(SMTP_PASSWORD in line for line in lines)


def test_a_mail_server_that_refuses_costs_no_outcome(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_email_dag", DAG)
    wrong_password = "not-the-Password-7731"
    with smtp_server() as mailbox:
        _run_to_failure(services, sessions, mailbox.env(password=wrong_password))
        wait_for(
            lambda: services.log("worker").count("not sent: SMTPAuthenticationError") == 2,
            timeout=60,
            what="the two refused alerts logged",
        )
    assert mailbox.messages == []
    log = services.log("worker")
    assert wrong_password not in log and SMTP_PASSWORD not in log
