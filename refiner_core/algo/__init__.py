"""GRPO's math without I/O: advantages, losses, packing, the EMA teacher's average."""
