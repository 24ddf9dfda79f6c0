"""Email alerts and the SMTP settings: what a failed try mails (Airflow's default alert), to
whom, when; a malformed DEFERRAL_SMTP_* setting named; the password never shown."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from deferral import DAG
from deferral.exceptions import DagDefinitionError
from deferral.operators.email import EmailOperator
from deferral.operators.empty import EmptyOperator
from deferral.runtime.config import ConfigError, SmtpSettings, smtp_settings
from deferral.runtime.secrets_masker import redact
from deferral.utils.email import (
    EmailAlert,
    EmailNotConfigured,
    failure_alert,
    get_email_address_list,
    send_email,
)
from tests.smtp import free_port, smtp_server
from worker.mail import Mail, Mailer

SMTP = {"DEFERRAL_SMTP_HOST": "mail.example.com", "DEFERRAL_SMTP_MAIL_FROM": "d@example.com"}


def _alert(task: Any, *, retrying: bool, map_index: int = -1) -> EmailAlert | None:
    return failure_alert(
        task,
        retrying=retrying,
        dag_id="etl",
        run_id="manual__1",
        map_index=map_index,
        try_number=1,
        max_tries=2,
        error="ValueError: <b>bad</b>\nsecond line",
        hostname="w1",
    )


def test_alert_is_airflows_default_subject_and_body() -> None:
    with DAG("etl"):
        task = EmptyOperator(task_id="load", email="a@example.com; b@example.com")
    alert = _alert(task, retrying=True)
    assert alert == EmailAlert(
        ("a@example.com", "b@example.com"),
        "deferral alert: <TaskInstance: etl.load manual__1 [up_for_retry]>",
        "Try 1 out of 3<br>Exception:<br>ValueError: &lt;b&gt;bad&lt;/b&gt;<br>second line<br>"
        "Log: deferral tasks logs etl manual__1 load --try 1<br>Host: w1<br>",
    )
    mapped = _alert(task, retrying=False, map_index=4)
    assert mapped is not None
    assert mapped.subject.endswith("manual__1 map_index=4 [failed]>")
    assert "--try 1 --map-index 4<br>" in mapped.html_content


def test_alert_follows_the_flag_of_its_outcome() -> None:
    with DAG("etl"):
        no_retry_mail = EmptyOperator(task_id="a", email=["x@example.com"], email_on_retry=False)
        no_address = EmptyOperator(task_id="b", email_on_failure=True)
    assert _alert(no_retry_mail, retrying=True) is None
    assert _alert(no_retry_mail, retrying=False) is not None
    assert _alert(no_address, retrying=False) is None


def test_address_lists() -> None:
    assert get_email_address_list("a@x.com, b@x.com;c@x.com") == ["a@x.com", "b@x.com", "c@x.com"]
    assert get_email_address_list(["a@x.com", " "]) == ["a@x.com"]


def test_smtp_settings_defaults_and_no_host() -> None:
    assert smtp_settings({}) is None
    assert smtp_settings({"DEFERRAL_SMTP_HOST": ""}) is None
    smtp = smtp_settings(SMTP)
    assert smtp is not None
    assert (smtp.port, smtp.starttls, smtp.ssl, smtp.timeout_sec) == (25, True, False, 30.0)
    assert smtp.user is None and smtp.password is None


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"DEFERRAL_SMTP_MAIL_FROM": ""}, "DEFERRAL_SMTP_MAIL_FROM is not set"),
        ({"DEFERRAL_SMTP_MAIL_FROM": "nobody"}, "DEFERRAL_SMTP_MAIL_FROM is malformed"),
        ({"DEFERRAL_SMTP_PORT": "70000"}, "DEFERRAL_SMTP_PORT is malformed"),
        ({"DEFERRAL_SMTP_STARTTLS": "maybe"}, "DEFERRAL_SMTP_STARTTLS is malformed"),
        ({"DEFERRAL_SMTP_SSL": "true"}, "DEFERRAL_SMTP_SSL and DEFERRAL_SMTP_STARTTLS"),
        ({"DEFERRAL_SMTP_USER": "u"}, "DEFERRAL_SMTP_USER is set without"),
        ({"DEFERRAL_SMTP_PASSWORD": "p4ssw0rd"}, "DEFERRAL_SMTP_PASSWORD is set without"),
        ({"DEFERRAL_SMTP_TIMEOUT_SEC": "0"}, "DEFERRAL_SMTP_TIMEOUT_SEC is malformed"),
    ],
)
def test_malformed_smtp_setting_is_named(extra: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as raised:
        smtp_settings({**SMTP, **extra})
    assert "p4ssw0rd" not in str(raised.value)


def test_smtp_password_is_masked_and_not_in_the_repr() -> None:
    password = "Smtp-pass-9931"
    smtp = smtp_settings({**SMTP, "DEFERRAL_SMTP_USER": "u", "DEFERRAL_SMTP_PASSWORD": password})
    assert smtp is not None and smtp.password == password
    assert password not in repr(smtp)
    assert redact(f"login failed for {password}") == "login failed for ***"


def test_smtp_password_from_a_file(tmp_path: Path) -> None:
    """A Docker secret: the password in a file that DEFERRAL_SMTP_PASSWORD_FILE names."""
    secret_file = tmp_path / "smtp_password"
    secret_file.write_text("Filed-pass-5512\n")
    env = {**SMTP, "DEFERRAL_SMTP_USER": "u", "DEFERRAL_SMTP_PASSWORD_FILE": str(secret_file)}
    smtp = smtp_settings(env, toml_path=tmp_path / "none.toml")
    assert smtp is not None and smtp.password == "Filed-pass-5512"
    assert redact("Filed-pass-5512") == "***"
    with pytest.raises(ConfigError, match="SMTP_PASSWORD and DEFERRAL_SMTP_PASSWORD_FILE"):
        smtp_settings({**env, "DEFERRAL_SMTP_PASSWORD": "x"}, toml_path=tmp_path / "none.toml")


def test_send_email_without_a_server_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEFERRAL_SMTP_HOST", raising=False)
    with pytest.raises(EmailNotConfigured, match="DEFERRAL_SMTP_HOST is not set"):
        send_email("a@example.com", "s", "<p>x</p>")


def _mailer_says(smtp: SmtpSettings | None, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the mailer logs of one alert it is handed."""
    mailer = Mailer(smtp)
    alert = EmailAlert(("ops@example.com",), "subject", "<p>body</p>")
    with caplog.at_level(logging.INFO, logger="deferral.worker.mail"):
        mailer.send([Mail(alert, "etl.r.load", {})])
        mailer.close()
    return [r.getMessage() for r in caplog.records]


def test_mailer_logs_one_line_when_the_server_is_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens on the port: the alert is dropped with one line naming the task."""
    env = {**SMTP, "DEFERRAL_SMTP_HOST": "127.0.0.1", "DEFERRAL_SMTP_PORT": str(free_port())}
    assert _mailer_says(smtp_settings({**env, "DEFERRAL_SMTP_STARTTLS": "false"}), caplog) == [
        "email alert for etl.r.load to ops@example.com not sent: ConnectionRefusedError:"
        " [Errno 111] Connection refused"
    ]


def test_mailer_without_smtp_settings_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    assert _mailer_says(None, caplog) == [
        "email alert for etl.r.load to ops@example.com not sent: DEFERRAL_SMTP_HOST is not set"
    ]


@pytest.mark.filterwarnings("ignore:Requiring AUTH:UserWarning")
def test_email_operator_sends_through_the_smtp_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    report = tmp_path / "report.csv"
    report.write_text("a,b\n1,2\n")
    with DAG("mail"):
        task = EmailOperator(
            task_id="send",
            to="ops@example.com",
            cc=["lead@example.com"],
            subject="Report",
            html_content="<p>done</p>",
            files=[str(report)],
            custom_headers={"X-Team": "data"},
        )
    with smtp_server() as mailbox:
        for key, value in mailbox.env().items():
            monkeypatch.setenv(key, value)
        task.execute({})  # type: ignore[arg-type]
    (message,) = mailbox.messages
    assert mailbox.recipients == [["ops@example.com", "lead@example.com"]]
    assert (message["Subject"], message["Cc"]) == ("Report", "lead@example.com")
    assert message["X-Team"] == "data"
    attachment = next(message.iter_attachments())
    assert attachment.get_filename() == "report.csv"
    assert attachment.get_content() == "a,b\n1,2\n"


def test_email_operator_needs_an_address_and_the_smtp_settings() -> None:
    with DAG("mail"):
        with pytest.raises(DagDefinitionError, match="to must be an address"):
            EmailOperator(task_id="send", to=[], subject="s", html_content="x")
        with pytest.raises(DagDefinitionError, match="conn_id='smtp_ses' is not supported"):
            EmailOperator(
                task_id="ses", to="a@x.com", subject="s", html_content="x", conn_id="smtp_ses"
            )
        EmailOperator(task_id="default", to="a@x.com", subject="s", html_content="x")
    with pytest.raises(ValueError, match="mail goes through the DEFERRAL_SMTP_"):
        send_email("a@x.com", "s", "x", conn_id="smtp_ses")
