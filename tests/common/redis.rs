//! Real `redis-server` processes for tests (filled in by the Redis backend work).
