"""How many idle time triggers one triggerer holds: memory per trigger and event-loop lag.

    .venv/bin/python benchmarks/triggerer_density.py --n 100000

Starts one triggerer (``triggerer consume``'s service, with a lag probe in its event loop:
``probed_triggerer.py``) with ``--capacity N`` on a fresh database and stream prefix, measures
its resident memory, then seeds N deferred tasks waiting on ``DateTimeTrigger``s a day or two
ahead (rows and sealed trigger entries written as a worker would, without running N attempts),
waits until the triggerer holds them all, holds them for ``--hold`` seconds (several heartbeats:
lease renewals and the "still wanted?" check run meanwhile) and reports:

- RSS per trigger: (RSS holding N - RSS holding none) / N;
- event-loop lag p50 / p99 / max while holding them: how late a 10 ms sleep in the triggerer's
  own loop wakes (and, for information, the same while the entries were being taken in).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from harness import Figure, Profiles, Stack, median, percentile, report, rss_kib, wait_for

PROBED = Path(__file__).with_name("probed_triggerer.py")


def lags_between(lag_file: Path, start: float, end: float) -> list[float]:
    """Lag samples (ms) taken between two unix times."""
    samples = []
    for line in lag_file.read_text().splitlines():
        at, _, lag = line.partition(" ")
        if start <= float(at) <= end:
            samples.append(float(lag))
    return samples


def steady_rss(pid: int, seconds: float = 2.0) -> int:
    """The median of a few RSS readings, KiB."""
    readings = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        readings.append(rss_kib(pid))
        time.sleep(0.2)
    return int(median(readings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="time triggers held")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="DEFERRAL_HEARTBEAT_SEC")
    parser.add_argument("--hold", type=float, default=30.0, help="seconds measured once held")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--profile", action="store_true", help="py-spy the triggerer")
    args = parser.parse_args()
    n = args.n

    with Stack(heartbeat_sec=args.heartbeat, keep=args.keep_logs) as stack:
        lag_file = stack.logs / "lag.txt"
        proc = stack.start(
            "triggerer1",
            "--capacity",
            str(n),
            program=[sys.executable, str(PROBED), str(lag_file)],
        )
        stack.wait_started("triggerer1")
        time.sleep(2 * args.heartbeat)  # a couple of idle beats: imports and pools settle
        rss_empty = steady_rss(proc.pid)

        with Profiles(stack, ["triggerer1"] if args.profile else []) as profiles:
            seeding = time.time()
            stack.seed_time_triggers(
                n, dt.datetime.now(dt.UTC) + dt.timedelta(days=1), dt.timedelta(days=1)
            )
            seeded = time.time()
            wait_for(
                lambda: stack.pending_triggers().per_consumer.get("triggerer1", 0) >= n,
                timeout=1800,
                interval=0.2,
                what=f"the triggerer to hold {n} triggers",
            )
            held = time.time()
            print(
                f"seeded {n} in {seeded - seeding:.1f} s; all held {held - seeding:.1f} s after"
                " seeding began",
                flush=True,
            )
            time.sleep(args.hold)
            rss_full = steady_rss(proc.pid)
            ended = time.time()
        loading = lags_between(lag_file, seeding, held)
        holding = lags_between(lag_file, held, ended)
        blocked = [line for line in stack.log("triggerer1").splitlines() if "blocked" in line]
        if args.profile:  # before the stack's folder (the raw profiles in it) is removed
            print(profiles.summary())

    per_trigger = (rss_full - rss_empty) * 1024 / n
    ok = report(
        f"triggerer_density: {n} idle time triggers in one triggerer"
        f" (heartbeat {args.heartbeat:g} s, held {args.hold:g} s)",
        [
            Figure("RSS per trigger", per_trigger, "bytes", 3000),
            Figure("event-loop lag p50 while holding", median(holding), "ms"),
            Figure("event-loop lag p99 while holding", percentile(holding, 0.99), "ms", 50),
            Figure("event-loop lag max while holding", max(holding), "ms"),
            Figure("event-loop lag p99 while taking them in", percentile(loading, 0.99), "ms"),
            Figure("taking them in", n / max(held - seeding, 1e-9), "triggers/s", at_most=False),
        ],
        notes=[
            f"RSS {rss_empty / 1024:.1f} MiB holding none, {rss_full / 1024:.1f} MiB holding {n}",
            *[f"triggerer said: {line}" for line in blocked[-3:]],
        ],
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
