"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, so the official
clients raise their usual exceptions (401 AuthenticationError, 404 NotFoundError, 400
BadRequestError). Messages name the problem and never quote a key."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(kind: str, id_: str) -> ApiError:
    # The same answer for "no such id" and "another key's id": an id proves nothing about its owner.
    return ApiError(404, f"No such {kind}: {id_[:64]}", code="not_found", param="id")
