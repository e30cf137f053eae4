"""HTTP only: the FastAPI app, its routes, the auth dependency and the one error handler."""
