"""Read models: what the dashboard, the admin and /metrics show, computed from the database
and storage at the moment of asking. Nothing here changes state; state changes are the
services' (`jobs/services/`)."""
