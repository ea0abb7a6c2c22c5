"""The SFT warm start: its data and its training loop."""
