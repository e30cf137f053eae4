"""Persistence: the database engine and sessions, the ORM tables, tenants and API keys, the on-disk
record spool."""
