"""Integrations with other frameworks; each imports its framework, nothing else does."""
