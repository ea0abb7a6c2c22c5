"""Prefect flows: they wire the stages of refiner_core into a DAG and do nothing else."""
