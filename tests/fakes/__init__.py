"""Stand-ins the tests run instead of real ones: a toy suite, a fake world of ranks, a framework's loss, synthetic nights."""
