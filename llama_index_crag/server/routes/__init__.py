"""The server's routes, one router per concern: the native query API, the OpenAI-compatible API, and admin."""
