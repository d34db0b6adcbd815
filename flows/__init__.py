"""Prefect flows: the run-level supervisors. They decide what runs where and react to failures."""
