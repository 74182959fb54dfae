"""`tierkv serve-engine`: our engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""
