"""Probes that measure a rank while it runs: collectives (and, later, memory and timers)."""
