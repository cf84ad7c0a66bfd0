"""The strategies' parse-time declarations: distlab/configuration/strategies/<name>_settings.py
(torch-free), found by distlab.configuration.strategies.settings.registered. They are the list of
strategies; each one's rank-time module is distlab/strategies/<name>.py."""
