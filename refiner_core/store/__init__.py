"""Files and tables: storage I/O, the catalog, checkpoints, SQL over runs, cards, the Hub, trackers, plots."""
