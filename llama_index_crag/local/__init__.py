"""The offline defaults: bundled models, the portable llama.cpp build, the embedding cache and the doctor."""
