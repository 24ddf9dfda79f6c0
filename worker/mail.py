"""Sends the email alerts of committed failures (``email_on_failure`` / ``email_on_retry``), on a
thread of its own: an SMTP server that is slow or down never holds the worker's loop (which
renews leases every heartbeat), and never costs a task its outcome, which is committed before
its alert is handed here. A mail that cannot be sent is logged in one line and dropped, as
Airflow does."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from deferral.runtime.config import SmtpSettings
from deferral.runtime.process import LogExtra
from deferral.runtime.secrets_masker import redact
from deferral.utils.email import EmailAlert, send_email

log = logging.getLogger("deferral.worker.mail")


@dataclass(frozen=True)
class Mail:
    """An alert about one attempt (``label``, ``ids``: whom the log line is about)."""

    alert: EmailAlert
    label: str
    ids: LogExtra


class Mailer:
    def __init__(self, smtp: SmtpSettings | None) -> None:
        self.smtp = smtp
        self.outbox: queue.Queue[Mail | None] = queue.Queue()
        self.thread = threading.Thread(target=self._send_all, name="mailer", daemon=True)
        self.thread.start()

    def send(self, mails: list[Mail]) -> None:
        """Queue alerts whose failures are committed."""
        for mail in mails:
            if self.smtp is None:
                log.warning(
                    "email alert for %s to %s not sent: DEFERRAL_SMTP_HOST is not set",
                    mail.label,
                    ", ".join(mail.alert.to),
                    extra=mail.ids,
                )
            else:
                self.outbox.put(mail)

    def close(self) -> None:
        """Send what is queued, for up to one SMTP timeout, then stop."""
        self.outbox.put(None)
        self.thread.join(self.smtp.timeout_sec if self.smtp is not None else 0)

    def _send_all(self) -> None:
        while (mail := self.outbox.get()) is not None:
            alert = mail.alert
            try:
                send_email(alert.to, alert.subject, alert.html_content, settings=self.smtp)
            except Exception as exc:
                error = redact(f"{type(exc).__name__}: {exc}").splitlines()
                log.warning(
                    "email alert for %s to %s not sent: %s",
                    mail.label,
                    ", ".join(alert.to),
                    error[0] if error else type(exc).__name__,
                    extra=mail.ids,
                )
            else:
                log.info(
                    "email alert for %s sent to %s", mail.label, ", ".join(alert.to), extra=mail.ids
                )
