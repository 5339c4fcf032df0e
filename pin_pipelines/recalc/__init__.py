"""Spec 000 (project-aggregates-recalc): the debounce queue, its drain and the outbox writes."""
