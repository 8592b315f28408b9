"""OpenAI-shaped error bodies for the HTTP server (spec/reliability-matrix.md §1, E5, E6).

Every client error leaves as `{"error": {"message", "type", "param", "code"}}` with `code` a string or
null, never llama.cpp's integer. Nothing here touches the engine.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request the server refuses; carries the HTTP status and the OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
