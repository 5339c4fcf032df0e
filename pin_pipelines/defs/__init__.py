"""Dagster wiring only: each domain's assets, jobs, sensors and checks call the plain core."""
