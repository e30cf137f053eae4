"""Jobs as users see them: create, read, cancel and pause jobs; their files, events, checkpoints,
artifacts and the ingest of what the workers report."""
