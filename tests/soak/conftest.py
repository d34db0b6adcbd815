"""The soak tests' fixtures: the integration tests' real Prefect API (a session-scoped test-harness server)."""

from tests.integration.conftest import prefect_api  # noqa: F401
