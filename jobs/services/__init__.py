"""Every state change of the service, written once and used by the API, the dashboard, the
admin and the RQ tasks. Functions take keyword-only arguments and say their side effects.
What a refusal looks like is `jobs.lib.errors`, which reads share."""
