"""A run that has stopped making progress: noticed on every rank and ended, for its launcher to restart
(:mod:`liveness.watchdog`)."""
