"""Email, as Airflow's ``airflow.utils.email``: ``send_email`` through the SMTP server of the
``DEFERRAL_SMTP_*`` settings, and the alert a task's ``email_on_failure`` / ``email_on_retry``
sends (``failure_alert``), worded as Airflow's default alert.

The alert is composed in the task's process, which knows the task and its exception, and sent by
the worker once the outcome it reports is committed (``worker.mail``): a failing mail server
never costs a task its outcome.
"""

from __future__ import annotations

import html
import mimetypes
import smtplib
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from pathlib import Path
from typing import Any

from deferral.runtime.config import SmtpSettings, smtp_settings

__all__ = ["EmailAlert", "failure_alert", "get_email_address_list", "send_email"]


# The ``conn_id``s accepted: none, or Airflow's default (whose settings DEFERRAL_SMTP_* are).
CONN_IDS = (None, "smtp_default")


def conn_id_refusal(conn_id: Any) -> str:
    return (
        f"conn_id={conn_id!r} is not supported by deferral: mail goes through the"
        " DEFERRAL_SMTP_* server (Airflow's smtp_default)"
    )


class EmailNotConfigured(RuntimeError):
    """No ``DEFERRAL_SMTP_HOST``: deferral has nowhere to send mail."""


@dataclass(frozen=True)
class EmailAlert:
    """One alert about a task's try, ready to send."""

    to: tuple[str, ...]
    subject: str
    html_content: str


def get_email_address_list(addresses: str | Iterable[str]) -> list[str]:
    """Addresses given as one string (separated by ``,`` or ``;``) or a list of them."""
    if isinstance(addresses, str):
        addresses = addresses.replace(";", ",").split(",")
    return [address.strip() for address in addresses if address.strip()]


def check_email_argument(value: Any) -> str | None:
    """Why a task's ``email`` argument is malformed, or None: Airflow takes a string (one or
    more addresses, separated by ``,`` or ``;``) or a list of strings."""
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, list | tuple | set | frozenset) and all(
        isinstance(item, str) for item in value
    ):
        return None
    return f"email must be an address, a list of addresses or None, got {value!r}"


def failure_alert(
    task: Any,
    *,
    retrying: bool,
    dag_id: str,
    run_id: str,
    map_index: int,
    try_number: int,
    max_tries: int,
    error: str,
    hostname: str,
) -> EmailAlert | None:
    """The alert a try of ``task`` that failed with ``error`` (secrets already masked) sends to
    the task's ``email``, into a retry (``retrying``: if ``email_on_retry``) or for good (if
    ``email_on_failure``); None when none is due. Airflow's default subject and body, with the
    ``deferral tasks logs`` command where Airflow links its log page."""
    flag = "email_on_retry" if retrying else "email_on_failure"
    to = tuple(get_email_address_list(getattr(task, "email", None) or ()))
    if not to or not getattr(task, flag, True):  # Airflow's defaults: both flags True
        return None
    state = "up_for_retry" if retrying else "failed"
    mapped = f" map_index={map_index}" if map_index >= 0 else ""
    subject = f"deferral alert: <TaskInstance: {dag_id}.{task.task_id} {run_id}{mapped} [{state}]>"
    logs = f"deferral tasks logs {dag_id} {run_id} {task.task_id} --try {try_number}"
    if map_index >= 0:
        logs += f" --map-index {map_index}"
    lines = [
        f"Try {try_number} out of {max_tries + 1}",
        "Exception:",
        html.escape(error).replace("\n", "<br>"),
        f"Log: {html.escape(logs)}",
        f"Host: {html.escape(hostname)}",
    ]
    return EmailAlert(to, subject, "".join(f"{line}<br>" for line in lines))


def send_email(
    to: str | Iterable[str],
    subject: str,
    html_content: str,
    files: Iterable[str] | None = None,
    dryrun: bool = False,
    cc: str | Iterable[str] | None = None,
    bcc: str | Iterable[str] | None = None,
    mime_subtype: str = "mixed",
    mime_charset: str = "utf-8",
    conn_id: str | None = None,
    custom_headers: Mapping[str, str] | None = None,
    from_email: str | None = None,
    settings: SmtpSettings | None = None,
) -> None:
    """Send an HTML email (``files`` attached, ``custom_headers`` added) through the
    ``DEFERRAL_SMTP_*`` server (or ``settings``), as Airflow's ``send_email``; ``dryrun`` builds
    it without sending. ``conn_id``: only Airflow's ``smtp_default`` (the server is deferral's
    settings, not a Connection). Raises EmailNotConfigured without ``DEFERRAL_SMTP_HOST``, and
    smtplib's errors as they come."""
    if conn_id not in CONN_IDS:
        raise ValueError(conn_id_refusal(conn_id))
    smtp = settings or smtp_settings()
    if smtp is None:
        raise EmailNotConfigured("DEFERRAL_SMTP_HOST is not set: deferral has no SMTP server")
    recipients = get_email_address_list(to)
    message = EmailMessage()
    message["Subject"] = subject
    message["From"] = from_email or smtp.mail_from
    message["To"] = ", ".join(recipients)
    for header, addresses in (("Cc", cc), ("Bcc", bcc)):
        if addresses:
            listed = get_email_address_list(addresses)
            recipients += listed
            if header == "Cc":
                message[header] = ", ".join(listed)
    for name, value in (custom_headers or {}).items():
        message[name] = value
    message.set_content(html_content, subtype="html", charset=mime_charset)
    if files:
        if mime_subtype == "related":
            message.make_related()
        else:
            message.make_mixed()
        for name in files:
            path = Path(name)
            kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            maintype, subtype = kind.split("/", 1)
            message.add_attachment(
                path.read_bytes(), maintype=maintype, subtype=subtype, filename=path.name
            )
    if not dryrun:
        send_message(smtp, message, recipients)


def send_message(smtp: SmtpSettings, message: EmailMessage, recipients: list[str]) -> None:
    """Deliver ``message`` to ``recipients`` through ``smtp``: SSL from the start, or STARTTLS
    on a plain connection; logged in when a user is set."""
    client: smtplib.SMTP
    if smtp.ssl:
        client = smtplib.SMTP_SSL(
            smtp.host, smtp.port, timeout=smtp.timeout_sec, context=ssl.create_default_context()
        )
    else:
        client = smtplib.SMTP(smtp.host, smtp.port, timeout=smtp.timeout_sec)
    with client:
        if smtp.starttls:
            client.starttls(context=ssl.create_default_context())
        if smtp.user is not None and smtp.password is not None:
            client.login(smtp.user, smtp.password)
        client.send_message(message, from_addr=None, to_addrs=recipients)
