"""The scheduler service: DAG runs, dependencies, dispatch, and resuming deferred tasks."""
