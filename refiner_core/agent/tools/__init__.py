"""Tools the agent may call; each registers in TOOLS (tools/base.py)."""
