"""A real SMTP server (aiosmtpd) on a free local port, keeping the messages it accepts: what the
email tests send to. It asks for a login (plain text: no TLS on the loopback)."""

from __future__ import annotations

import email
import email.policy
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import EmailMessage
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, Envelope, LoginPassword

SMTP_USER = "alerts"
SMTP_PASSWORD = "smtp-Secret-4821"


@dataclass
class Mailbox:
    port: int
    messages: list[EmailMessage] = field(default_factory=list)
    recipients: list[list[str]] = field(default_factory=list)
    logins: list[str] = field(default_factory=list)

    def env(self, password: str = SMTP_PASSWORD) -> dict[str, str]:
        """The DEFERRAL_SMTP_* settings of a process that sends here."""
        return {
            "DEFERRAL_SMTP_HOST": "127.0.0.1",
            "DEFERRAL_SMTP_PORT": str(self.port),
            "DEFERRAL_SMTP_STARTTLS": "false",
            "DEFERRAL_SMTP_USER": SMTP_USER,
            "DEFERRAL_SMTP_PASSWORD": password,
            "DEFERRAL_SMTP_MAIL_FROM": "deferral@example.com",
            "DEFERRAL_SMTP_TIMEOUT_SEC": "10",
        }

    async def handle_DATA(self, server: Any, session: Any, envelope: Envelope) -> str:
        assert isinstance(envelope.content, bytes)
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        assert isinstance(message, EmailMessage)
        self.messages.append(message)
        self.recipients.append(list(envelope.rcpt_tos))
        return "250 OK"

    def authenticate(
        self, server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any
    ) -> AuthResult:
        assert isinstance(auth_data, LoginPassword)
        self.logins.append(auth_data.login.decode())
        accepted = (auth_data.login, auth_data.password) == (
            SMTP_USER.encode(),
            SMTP_PASSWORD.encode(),
        )
        return AuthResult(success=accepted, handled=False)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def smtp_server() -> Iterator[Mailbox]:
    mailbox = Mailbox(free_port())
    controller = _controller(mailbox)
    controller.start()
    try:
        yield mailbox
    finally:
        controller.stop()


def _controller(mailbox: Mailbox) -> Controller:
    # aiosmtpd warns (UserWarning) that a login without TLS can be read on the wire: here, on
    # the loopback; tests filter it.
    return Controller(
        mailbox,
        hostname="127.0.0.1",
        port=mailbox.port,
        authenticator=mailbox.authenticate,
        auth_required=True,
        auth_require_tls=False,
        ready_timeout=60,
    )
