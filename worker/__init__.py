"""genq worker: claims jobs from Redis into an engine and publishes their events."""
