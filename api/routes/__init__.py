"""One router per resource: files, jobs, events (SSE), memory, ingest, health, pages."""
