"""Helpers shared by the test suites (real services started locally, fault injection)."""
