"""Detached jobs: their runs, their records in the store, and the watch their event streams share."""
