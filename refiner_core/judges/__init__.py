"""Rubric judges: the interface and reward scoring in base.py, one file per backend."""
