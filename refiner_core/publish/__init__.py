"""What a run shows and hands on: the catalog and its views, SQL over runs, model cards, the Hub, experiment
trackers, plots. Above every stage's code, which imports none of it."""
