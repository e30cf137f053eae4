"""The memfit command (server, scheduler, run, jobs, files, plan); the only package that may start the API."""
