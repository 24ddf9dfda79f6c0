"""EmailOperator (Airflow's ``airflow.operators.email``): sends an email through the
``DEFERRAL_SMTP_*`` server when the task runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.exceptions import DagDefinitionError
from deferral.utils.email import CONN_IDS, check_email_argument, conn_id_refusal, send_email


class EmailOperator(BaseOperator):
    """Sends ``html_content`` (templated; a ``.html`` file is a template file) with ``subject``
    to ``to`` (and ``cc``, ``bcc``), ``files`` attached. The task fails if the server refuses
    the mail, or if no ``DEFERRAL_SMTP_HOST`` is set."""

    template_fields: Sequence[str] = ("to", "subject", "html_content", "files")
    template_ext: Sequence[str] = (".html",)

    def __init__(
        self,
        *,
        to: str | Sequence[str],
        subject: str,
        html_content: str,
        files: Sequence[str] | None = None,
        cc: str | Sequence[str] | None = None,
        bcc: str | Sequence[str] | None = None,
        mime_subtype: str = "mixed",
        mime_charset: str = "utf-8",
        conn_id: str = "smtp_default",
        custom_headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if conn_id not in CONN_IDS:
            raise DagDefinitionError(f"task {self.task_id!r}: {conn_id_refusal(conn_id)}")
        for name, addresses in (("to", to), ("cc", cc), ("bcc", bcc)):
            error = check_email_argument(addresses)
            if error or (name == "to" and not addresses):
                raise DagDefinitionError(
                    f"task {self.task_id!r}: {name} must be an address or a list of addresses,"
                    f" got {addresses!r}"
                )
        self.to = to
        self.subject = subject
        self.html_content = html_content
        self.files = list(files or [])
        self.cc = cc
        self.bcc = bcc
        self.mime_subtype = mime_subtype
        self.mime_charset = mime_charset
        self.conn_id = conn_id
        self.custom_headers = custom_headers

    def execute(self, context: Context) -> None:
        send_email(
            self.to,
            self.subject,
            self.html_content,
            files=self.files,
            cc=self.cc,
            bcc=self.bcc,
            mime_subtype=self.mime_subtype,
            mime_charset=self.mime_charset,
            conn_id=self.conn_id,
            custom_headers=self.custom_headers,
        )
