"""Where chunks live: the index folder, in-memory search, one chunker for every ingest, and PostgreSQL."""
