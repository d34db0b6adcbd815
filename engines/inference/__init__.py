"""Embedded inference: a batched torch engine behind an OpenAI-compatible HTTP server."""
