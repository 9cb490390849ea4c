"""The HTTP service: a FastAPI app over a read-only view of a controller."""
