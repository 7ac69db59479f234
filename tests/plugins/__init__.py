"""Strategies and models written outside labkit: a tiny package the tests install, and how they install it."""
