"""Node tests run real ZMQ sockets on 127.0.0.1, real CURVE keys and real NIXL (the default data
plane); the shared helpers (``wait_for``, ``closing``, key pairs) are in ``tests/conftest.py``."""

import pytest

pytest.importorskip("nixl")
