"""Thin Prefect tasks: unpack params, call one `transformer` function, log to MLflow,
return a path (or, for the run's first and last tasks, the run's ids and scores)."""
