"""The tasks' parse-time declarations: distlab/configuration/tasks/<name>.py (or a package of that
name) holding a torch-free `DECLARATION`, found by distlab.configuration.tasks.declaration. They
are the list of tasks; each one's rank-time half is distlab/tasks/<name>."""
