"""ASGI middleware of rollflow's vLLM servers (`--middleware rollflow_vllm_auth.RequireToken`): every route but
/health answers 401 unless the request carries `Authorization: Bearer <token>`, the per-attempt secret the
launcher hands the server in ROLLFLOW_VLLM_TOKEN (environment only: argv is readable by every local user).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere (vllm 0.32,
entrypoints/serve/middleware/authenticate.py), which leaves the dev-mode routes rollflow needs for weight
updates (/pause, /resume, /collective_rpc) and the others dev mode adds (/sleep, /reset_prefix_cache, ...)
open to anyone who reaches the port. /health stays open: vllm-router and the launcher probe it without a
token, and it tells nothing. Runs in vLLM's API server process, so it imports only the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import os

TOKEN_ENV = "ROLLFLOW_VLLM_TOKEN"
OPEN_PATHS = frozenset({"/health"})
MIN_TOKEN_CHARS = 32
_BODY = (
    b'{"error": {"message": "this vLLM server answers rollflow\'s inference proxy only", '
    b'"type": "authentication_error", "code": 401}}'
)


class RequireToken:
    def __init__(self, app) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if len(token) < MIN_TOKEN_CHARS:  # fail closed: a server without the secret would be open
            raise RuntimeError(f"{TOKEN_ENV} must hold the launcher's per-attempt secret ({MIN_TOKEN_CHARS}+ chars)")
        self.app = app
        self.expected = hashlib.sha256(b"Bearer " + token.encode()).digest()

    def _allowed(self, scope) -> bool:
        if scope["path"] in OPEN_PATHS:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(hashlib.sha256(given).digest(), self.expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode())]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": _BODY})
