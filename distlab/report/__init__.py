"""Summary table and milestone report built from the runs' metrics.json files."""
