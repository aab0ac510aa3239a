"""Sweeps: hyperparameter searches whose trials are ordinary jobs (issue #27)."""
