"""Scheduled jobs built from `sidindex` and `runtime` (config file -> build -> publish -> report)."""
