"""Persistence: the database engine and sessions, the ORM tables, the one fenced status transition,
tenants and API keys, the workers' ingest tokens, the on-disk record spool."""
