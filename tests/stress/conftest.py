from tests.reliability.conftest import served  # noqa: F401 (the shared server fixture)
