"""Moves queued jobs onto a Ray cluster and follows them: the loop, validation, the Ray Jobs client,
a local Ray head, and the lifetime of the processes memfit starts."""
