"""``triggerer consume`` with a lag probe in its event loop, for ``triggerer_density.py``.

    probed_triggerer.py LAG_FILE --name NAME --capacity N

The very service ``triggerer consume`` runs (:class:`TriggererService`), plus one task in the same
event loop that sleeps 10 ms again and again and appends how late each wake-up was to LAG_FILE
(``<unix time> <lag ms>`` per line): what every trigger's wake-up suffers too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio

from deferral.runtime.process import settings_or_exit, setup_logging
from triggerer.service import TriggererService

PROBE_SEC = 0.01


class ProbedTriggerer(TriggererService):
    def __init__(self, *args: object, lag_file: Path, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lag_file = lag_file

    async def run(self) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._probe)
            await super().run()
            tasks.cancel_scope.cancel()

    async def _probe(self) -> None:
        with self.lag_file.open("a", buffering=1 << 16) as out:
            flushed = time.monotonic()
            while True:
                asleep = time.perf_counter()
                await anyio.sleep(PROBE_SEC)
                lag = time.perf_counter() - asleep - PROBE_SEC
                out.write(f"{time.time():.3f} {lag * 1000:.2f}\n")
                if time.monotonic() - flushed > 0.5:
                    out.flush()
                    flushed = time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lag_file", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--capacity", type=int, required=True)
    args = parser.parse_args()
    setup_logging("text")
    service = ProbedTriggerer(
        settings_or_exit(), capacity=args.capacity, name=args.name, lag_file=args.lag_file
    )
    anyio.run(service.run)


if __name__ == "__main__":
    main()
