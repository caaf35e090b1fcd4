"""The OpenAI-compatible HTTP server (aiohttp)."""
