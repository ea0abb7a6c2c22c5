"""Rows of the data sources, their validation (rubric fields included) and the quarantine; sources, prompts and
answer formats."""
