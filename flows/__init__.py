"""Prefect flows that chain the tasks, and their deployments."""
