"""kill -9 of a triggerer holding N triggers: how long until every one runs again on its peer;
and a triggerer restarted under its name with N entries pending to it: how long until it serves.

    .venv/bin/python benchmarks/failover.py --n 1000
    .venv/bin/python benchmarks/failover.py --n 100000 --repeat 3

Two triggerers (``triggerer consume``, heartbeat ``--heartbeat`` seconds, 1 by default) on a
fresh database and stream prefix; N deferred tasks waiting on ``DateTimeTrigger``s a day ahead are
seeded (as a worker would leave them) and all taken by the first. Then, ``--repeat`` times, the
triggerer holding them all is killed with SIGKILL at a random moment of its heartbeat, and the
benchmark polls (every 10 ms) until its peer holds every entry (Redis: the group's pending list)
and runs every trigger (Postgres: ``trigger.triggerer_id``, written once the trigger started).
The killed one is started again under its name and becomes the next peer.

The takeover threshold is 2.1 heartbeats after the last renewal, and peers look four times a
heartbeat, so with H = 1 s the floor is about 1.1 s and the ceiling about 2.35 s plus the work.

Then the restart: the triggerer holding none stops cleanly, the one holding all N is killed
with SIGKILL, ``trigger.triggerer_id`` is cleared, and the killed one is started again under
its name, alone: the time from its start until it says it consumes, and until it runs every
trigger again (all replayed from its own pending list: timers never ran code of their own, so
none is a suspect and none waits a heartbeat for its turn).
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import signal
import time

from harness import Figure, Profiles, Stack, median, report, wait_for
from sqlalchemy import func, select, update

from deferral.store.tables import Trigger


def running_on(stack: Stack, name: str) -> int:
    with stack.sessions() as session:
        return int(session.scalar(select(func.count()).where(Trigger.triggerer_id == name)) or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="triggers the killed triggerer held")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="DEFERRAL_HEARTBEAT_SEC")
    parser.add_argument("--repeat", type=int, default=5, help="kills")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--profile", action="store_true", help="py-spy both triggerers")
    args = parser.parse_args()
    n, beat = args.n, args.heartbeat
    rng = random.Random(args.seed)
    names = ["triggerer1", "triggerer2"]

    claimed: list[float] = []
    running: list[float] = []
    with Stack(heartbeat_sec=beat, keep=args.keep_logs) as stack:
        stack.start("triggerer1", "--capacity", str(n))
        stack.wait_started("triggerer1")
        stack.seed_time_triggers(
            n, dt.datetime.now(dt.UTC) + dt.timedelta(days=1), dt.timedelta(hours=1)
        )
        wait_for(
            lambda: running_on(stack, "triggerer1") >= n,
            timeout=600,
            what=f"triggerer1 to run {n} triggers",
        )
        stack.start("triggerer2", "--capacity", str(n))
        stack.wait_started("triggerer2")
        with Profiles(stack, names if args.profile else []) as profiles:
            for attempt in range(args.repeat):
                victim, peer = names[attempt % 2], names[(attempt + 1) % 2]
                time.sleep(3 * beat + rng.uniform(0, beat))  # a random phase of its heartbeat
                killed = time.monotonic()
                stack.signal(victim, signal.SIGKILL)
                wait_for(
                    lambda peer=peer: stack.pending_triggers().per_consumer.get(peer, 0) >= n,  # type: ignore[misc]
                    timeout=max(120, n / 200),
                    interval=0.01,
                    what=f"{peer} to hold every entry",
                )
                claimed.append(time.monotonic() - killed)
                wait_for(
                    lambda peer=peer: running_on(stack, peer) >= n,  # type: ignore[misc]
                    timeout=max(120, n / 200),
                    interval=0.01,
                    what=f"{peer} to run every trigger",
                )
                running.append(time.monotonic() - killed)
                print(
                    f"kill {attempt + 1}: {victim} -> {peer}: all held after {claimed[-1]:.2f} s,"
                    f" all running after {running[-1]:.2f} s",
                    flush=True,
                )
                stack.start(victim, "--capacity", str(n))
                stack.wait_started(victim)
                if args.profile:
                    break  # the next start would need a profiler of its own
        if args.profile:  # before the stack's folder (the raw profiles in it) is removed
            print(profiles.summary())
        holder, idle = peer, victim
        stack.signal(idle, signal.SIGTERM)  # holds nothing: nothing to hand off
        stack.procs[idle].wait(timeout=60)
        stack.signal(holder, signal.SIGKILL)
        with stack.sessions.begin() as session:
            session.execute(update(Trigger).values(triggerer_id=None))
        restarted = time.monotonic()
        stack.start(holder, "--capacity", str(n))
        stack.wait_started(holder)
        consuming = time.monotonic() - restarted
        wait_for(
            lambda: running_on(stack, holder) >= n,
            timeout=600,
            interval=0.05,
            what=f"{holder} to run every trigger again",
        )
        serving = time.monotonic() - restarted
        print(
            f"restart of {holder} with {n} pending: consuming after {consuming:.2f} s, all"
            f" running after {serving:.2f} s",
            flush=True,
        )

    worst_target = 2.6 if n <= 1000 else 3.0  # issue 30: 100,000 running again within 3 s
    ok = report(
        f"failover: kill -9 of a triggerer holding {n} triggers, heartbeat {beat:g} s,"
        f" {len(running)} kills",
        [
            Figure("kill -> all entries held by the peer, median", median(claimed), "s"),
            Figure("kill -> all triggers running again, median", median(running), "s"),
            Figure("kill -> all triggers running again, worst", max(running), "s", worst_target),
            Figure(f"restart with {n} pending -> consuming", consuming, "s"),
            Figure(f"restart with {n} pending -> all running again", serving, "s", 5.0),
        ],
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
