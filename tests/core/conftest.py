"""The device-runtime tests use the stub runtime fixtures of ``tests/runtime_stub.py`` (offered
suite-wide by ``tests/conftest.py``)."""

from runtime_stub import Call, StubRuntime  # noqa: F401  (re-exported for these tests)
