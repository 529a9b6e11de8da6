"""genq gateway: a stateless FastAPI app in front of the Redis queue."""
