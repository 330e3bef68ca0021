"""The plugin imports ectransport only through its public plugin API, ``ectransport.plugin``
(issue 15): every other ectransport module is internal and may change in any release."""

from __future__ import annotations

import pytest
from ectransport.testing.conformance import ectransport_imports, package_files, private_imports


def test_the_plugin_imports_nothing_of_ectransport_but_the_plugin_api():
    files = package_files("ectransport_shm")
    assert {f.name for f in files} >= {"__init__.py", "plane.py", "wire.py", "locality.py",
                                       "segments.py"}, "the scan did not find the package"
    assert private_imports("ectransport_shm") == []
    public = [f for f in files if "ectransport.plugin" in f.read_text()]
    assert public, "the plane does not import the plugin API at all?"


@pytest.mark.parametrize("source, found", [
    ("from ectransport.plugin import DataTransport\nimport ectransport.plugin\n", []),
    ("from ectransport import plugin\nfrom .wire import ShmGrant\n", []),
    ("from ectransport.data.serving import frame\n", [(1, "ectransport.data.serving")]),
    ("import os\nimport ectransport.errors as e\n", [(2, "ectransport.errors")]),
    ("import ectransport\n", [(1, "ectransport")]),
    ("from ectransport import errors, plugin\n", [(1, "ectransport.errors")]),
    ("def f():\n    from ectransport.store import Run\n", [(2, "ectransport.store")]),
    ("s = 'from ectransport.data import base'  # ectransport.errors\n", []),
])
def test_the_import_scan_detects_internal_imports(source, found):
    assert ectransport_imports(source) == found
