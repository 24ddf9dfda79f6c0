"""``deferral-healthcheck``: a container healthcheck that costs almost nothing.

``deferral health`` imports the whole CLI and opens PostgreSQL and Redis (about 0.9 CPU-seconds
a check); every ten seconds in every container, that was most of an idle stack's CPU. This
probe uses the standard library only and asks the process itself: a service is healthy while its
main loop's latest iteration (``deferral_loop_iteration_timestamp_seconds`` on its metrics port:
set after a step that reached its servers) is recent; the web UI, while its health page answers.
Exit 0 healthy, 1 not, with one line saying why.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request

LOOP_METRIC = "deferral_loop_iteration_timestamp_seconds"
DEFAULT_MAX_AGE_SEC = 30.0


def loop_age_sec(metrics_text: str, now: float) -> float | None:
    """Seconds since the loop's latest iteration, from a scrape's text (None: not reported)."""
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name == LOOP_METRIC:
            stamp = float(value)
            return None if stamp <= 0 else max(0.0, now - stamp)
    return None


def verdict(metrics_text: str, now: float, max_age_sec: float) -> str | None:
    """Why the service is unhealthy, or None if it is healthy."""
    age = loop_age_sec(metrics_text, now)
    if age is None:
        return "its main loop has not completed an iteration yet"
    if age > max_age_sec:
        return f"its main loop last completed an iteration {age:.0f}s ago (over {max_age_sec:g}s)"
    return None


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        body: bytes = answer.read()
    return body.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deferral-healthcheck", description=__doc__)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("DEFERRAL_METRICS_PORT") or 0) or None,
        help="the service's metrics port (default: DEFERRAL_METRICS_PORT)",
    )
    parser.add_argument("--url", help="instead: healthy while this URL answers 200")
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_SEC)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.url is None and args.metrics_port is None:
        parser.error("give --metrics-port (or DEFERRAL_METRICS_PORT) or --url")
    url = args.url or f"http://127.0.0.1:{args.metrics_port}/metrics"
    try:
        text = _get(url, args.timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"unhealthy: no answer at {url}: {exc}", file=sys.stderr)
        return 1
    why = None if args.url else verdict(text, time.time(), args.max_age)
    if why is not None:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
