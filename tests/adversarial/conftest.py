from tests.node.conftest import closing  # noqa: F401  (fixture re-export)
