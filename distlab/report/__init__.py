"""Runs in the summary and report rules, after every run: the summary table and the milestone
report, functions of the files those rules declare (the runs' records), importing no torch."""
