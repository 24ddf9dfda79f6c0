"""What the forms and the API change, through the ``deferral`` command's own paths
(``deferral.store.actions``, ``deferral.signals``). Blocking: called in the thread pool."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from deferral import signals
from deferral.dag import DAG
from deferral.runtime.crypto import Cipher
from deferral.store import actions
from deferral.store.callback_tokens import Claim
from deferral.store.serialized_dags import StoredDag
from readmodel.dags import dag_to_change
from webserver import paramform
from webserver.inputs import MAX_JSON_DEPTH, BadInput, check_id, json_depth
from webserver.reads import required_id

if TYPE_CHECKING:
    from webserver.app import WebUI


class Writes:
    def __init__(self, ui: WebUI) -> None:
        self.ui = ui

    def dag(self, dag_id: str) -> StoredDag:
        """The DAG's parsed document (no DAG file is imported)."""
        with self.ui.sessions() as session:
            return dag_to_change(session, dag_id, self.ui.settings.dags_folder)

    def _with_own_timetable(self, stored: StoredDag) -> DAG:
        """The DAG object of a DAG whose timetable is its file's own class, which only the file
        makes again (its manual interval): the one write that imports a DAG file, only that
        one (``webserver.dagfiles``: a parse child first, within the import timeout)."""
        dag = self.ui.dag_files.dag(stored.dag_id, stored.fileloc)
        if dag is None:
            raise actions.ActionError(
                f"DAG {stored.dag_id!r} not found in {stored.fileloc}", not_found=True
            )
        return dag

    def trigger(
        self,
        dag_id: str,
        conf_text: str | None,
        run_id: str | None,
        form: Mapping[str, Any] | None = None,
        idempotency_key: actions.IdempotencyKey | None = None,
        partition_key: str | None = None,
    ) -> actions.Triggered:
        """Trigger a run with ``conf_text``'s conf; with the trigger page's ``form``, what its
        param fields give first (the conf text's keys win)."""
        if run_id:
            check_id("run_id", run_id)
        if conf_text and json_depth(conf_text) > MAX_JSON_DEPTH:
            raise BadInput(f"conf nests deeper than {MAX_JSON_DEPTH} levels")
        try:
            conf = actions.parse_conf(conf_text)
        except ValueError as exc:
            raise BadInput(f"conf: {exc}") from None
        stored = self.dag(dag_id)
        if form is not None:
            conf = {**paramform.conf_from_form(paramform.fields(stored.params), form), **conf}
        dag = stored if stored.timetable is not None else self._with_own_timetable(stored)
        return actions.trigger_run(
            self.ui.sessions,
            dag,
            conf,
            run_id or None,
            idempotency_key=idempotency_key,
            partition_key=partition_key,
        )

    def set_paused(self, dag_id: str, paused: bool) -> None:
        """Pause or unpause a DAG a scheduler parsed (its file is not read)."""
        actions.set_paused(self.ui.sessions, self.dag(dag_id), paused)

    def change(
        self, dag_id: str, params: Mapping[str, Any], change: actions.Change
    ) -> actions.UserChanges:
        map_indexes = params.get("map_indexes", ())
        if not isinstance(map_indexes, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in map_indexes
        ):
            raise BadInput("map_indexes must be a list of integers")
        # A task maps into at most max_map_length instances, numbered from 0.
        most = self.ui.settings.max_map_length
        if len(map_indexes) > most or not all(0 <= i < most for i in map_indexes):
            raise BadInput(f"map_indexes must be at most {most} integers from 0 to {most - 1}")
        return actions.change_tasks(
            self.ui.sessions,
            self.dag(dag_id),
            required_id(params, "run_id"),
            required_id(params, "task_id"),
            change,
            downstream=bool(params.get("downstream")),
            map_indexes=map_indexes,
        )

    def answer_callback(
        self,
        cipher: Cipher,
        claim: Claim,
        status: Any,
        payload: Any,
        idempotency_key: str | None = None,
    ) -> signals.SentSignal:
        with self.ui.sessions.begin() as session:
            sent = signals.answer_callback(session, cipher, claim, status, payload, idempotency_key)
        if sent.resumed:
            self.ui.wake_scheduler()
        return sent

    def callback_heartbeat(self, claim: Claim) -> dt.datetime:
        with self.ui.sessions.begin() as session:
            return signals.heartbeat(session, claim)
