"""Dead letters as ``deferral dead`` and the web UI's Streams page show them: where each came
from and why, never its token, payload or MAC, and whether it is verified (written by a deferral
process)."""

from __future__ import annotations

from broker import deadletters
from broker.client import Broker
from deferral.runtime.crypto import Cipher
from readmodel.records import Record

# Dead-letter entries the Streams page shows, newest first, and the fields shown of each.
DEAD_LETTERS_SHOWN = 20
DEAD_LETTER_FIELDS = (
    "source_stream",
    "source_id",
    "error",
    "deliveries",
    "task",
    "consumer",
)


def dead_letter_record(letter: deadletters.DeadLetter) -> Record:
    """A listing's row of one dead letter (``deferral dead list`` and ``show``)."""
    return {
        "id": letter.id,
        "added_at": letter.added_at,
        "stream": letter.source_stream,
        "task": letter.task or None,
        "deliveries": letter.deliveries,
        "reason": letter.error,
        "verified": letter.verified,
    }


def newest_shown(broker: Broker, cipher: Cipher, limit: int = DEAD_LETTERS_SHOWN) -> list[Record]:
    """The newest ``limit`` dead letters as the Streams page shows them: the clear fields each
    has (as written), and whether it is verified."""
    return [
        {
            "id": entry.id,
            **{
                name: entry.fields[name.encode()].decode(errors="replace")
                for name in DEAD_LETTER_FIELDS
                if name.encode() in entry.fields
            },
            "verified": deadletters.read_dead_letter(cipher, entry).verified,
        }
        for entry in broker.newest(broker.keys.dead, limit)
    ]
