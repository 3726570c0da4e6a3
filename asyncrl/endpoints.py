"""Where a run's services listen, shared through the run directory."""

ENDPOINTS_FILE = "endpoints.json"  # written by learner rank 0: {"buffer": "tcp://...", "sync": "tcp://..."}
