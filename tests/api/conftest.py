"""The API-style fixtures (``api``, ``py_api``, ``dd`` and the cpu runtime pin) from tests/api_styles.py."""

from api_styles import api, dd, host_addressable_device, py_api  # noqa: F401
