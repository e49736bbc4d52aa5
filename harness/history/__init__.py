"""Nightly history: every run's figures in one SQLite database (store), change points and slow creep
in a metric's series (changes), and the table / trend plots / bisect commands that show them (show)."""
