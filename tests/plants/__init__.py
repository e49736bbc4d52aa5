"""Engines and suites with a fault planted on purpose: each test shows a check failing on one."""
