"""APIError: what the HTTP layer answers when a request is bad (4xx) or the server cannot serve it (5xx), in
OpenAI's error body.

Owns: the error's status, type, param and code. Ignores: where it is raised.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client caused (4xx) or an unavailable server (5xx), rendered as OpenAI's error body."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
