"""The OpenAI-compatible local HTTP server: a thin adapter over engine.scheduler (no Qt, no inference)."""
