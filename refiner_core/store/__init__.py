"""Files and tables at the bottom of the stack: storage I/O (Parquet, JSON, DuckDB, atomic writes), the fault
points that test them, checkpoints."""
