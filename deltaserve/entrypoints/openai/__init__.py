"""OpenAI-compatible routes: /v1/completions and /v1/chat/completions."""
