"""Rows of the data sources, their validation and the quarantine; sources, prompts and answer formats."""
