"""Anthropic-compatible route: /v1/messages."""
