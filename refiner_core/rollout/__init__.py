"""Rollout engines: the interface in base.py, one file per backend."""
