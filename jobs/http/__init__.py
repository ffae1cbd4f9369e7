"""The HTTP layer both faces share: helpers, the polled routes' rows, /metrics."""
