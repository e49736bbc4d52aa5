"""The tests' own tools: ranks for a test function, a headless browser, the phase table."""
