"""Thin Prefect tasks: unpack params, call one `transformer` function, log to MLflow,
return a path."""
