"""The HTTP server: FastAPI app, shared request plumbing, errors and metrics (OpenAI and Anthropic routes beside)."""
