"""Processes and live state: child processes, the run lock, progress, registries, Ray, engines kept for a run,
the HTTP chat client, hardware detection, the heap kept out of full garbage collections."""
