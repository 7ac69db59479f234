"""Strategies written outside labkit, registered through the catalog by the tests."""
