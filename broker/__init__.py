"""Redis Streams transport: every stream key, field, message schema and Redis command."""
