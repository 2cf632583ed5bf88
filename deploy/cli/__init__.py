"""The ``pagedray`` command (main.py): its start-up checks and watch (startup.py) and how it stops
(shutdown.py). The only room that starts Ray. Nothing is imported here."""
