"""The read model: what the CLI and the web UI both show of PostgreSQL and Redis (records of runs,
task instances, processes and streams; the doctor's numbers; why a task is in its state; the one
line for a server that cannot be reached). It reads, it never changes state, and it knows neither
click nor HTTP, so that the CLI and the web UI can never disagree on what they report."""
