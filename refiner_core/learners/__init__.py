"""GRPO learners: the interface in base.py, one file per backend."""
