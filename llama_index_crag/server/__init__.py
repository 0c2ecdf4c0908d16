"""``llama-crag ingest`` and ``llama-crag serve``: a persisted index folder and the query server over it."""
