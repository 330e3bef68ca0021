"""Adapters for implementations that do not ship one of their own (run as scripts)."""
