"""Errors in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

Every refusal names the field at fault (`param`) where there is one; a status of 500 means a bug here.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import ContextLengthError, EngineUnavailableError, InvalidRequestError, LlamaError, ServerBusyError
from ..serving.streams import RequestFailedError

# What llama_core's validator calls a field, and what the API calls it.
_FIELD_NAMES = {"max_new_tokens": "max_tokens"}
_FIELD = re.compile(r"^([a-z_]+)")


class APIError(Exception):
    """A request refused or failed, as the OpenAI API reports it."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_llama_error(exc: LlamaError, fields: Iterable[str], rename: Optional[dict[str, str]] = None) -> APIError:
    """The API's answer to what llama_core raised for a request whose fields are `fields`: the field a
    message starts with becomes `param`, spelled as the request spelled it (`rename` maps llama_core's
    names, e.g. max_new_tokens, to the request's, e.g. max_completion_tokens)."""
    names = dict(_FIELD_NAMES, **(rename or {}))
    message = str(exc)
    for ours, theirs in names.items():
        message = re.sub(rf"\b{ours}\b", theirs, message)
    message = re.sub(r"^message (\d+)", r"messages[\1]", message)  # the dialog check counts messages from 0
    match = _FIELD.match(message)  # "temperature must be...", "messages[2] has role..."
    param = match.group(1) if match and match.group(1) in set(fields) else None
    if isinstance(exc, ContextLengthError):
        default = "messages" if "messages" in fields else "prompt"
        return APIError(400, message, param=param or default, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, message, param=param)
    if isinstance(exc, ServerBusyError):
        return APIError(503, message, type="server_error", code="server_busy", headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailedError) and not isinstance(exc, EngineUnavailableError):
        return APIError(500, message, type="server_error", code="generation_failed")
    return APIError(503, message, type="server_error", code="engine_unavailable", headers={"Retry-After": "5"})


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """The API's answer to a body pydantic could not read: malformed JSON, a missing field, a wrong type."""
    if not errors:
        return APIError(400, "the request body could not be read")
    first = next((error for error in errors if error.get("type") == "too_long"), errors[0])  # a union's branch
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + detail if detail else ''}")
    location = [part for part in first.get("loc", ()) if part != "body"]
    # A union's branch names ("str", "list[TextPart]") are pydantic's, not fields of the request.
    location = [part for part in location if not (isinstance(part, str) and ("[" in part or part in _TYPE_NAMES))]
    param = _dotted(location)
    if not param:
        return APIError(400, f"the request body must be a JSON object: {first.get('msg', 'unreadable')}")
    message = f"{param}: {_plain(first)}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "function-after", "constrained-str"}


def _plain(error: dict[str, Any]) -> str:
    if error.get("type") == "missing":
        return "this field is required"
    if error.get("type") == "too_long":  # its input unprinted: a list of millions
        actual, most = (error.get("ctx") or {}).get("actual_length"), (error.get("ctx") or {}).get("max_length")
        counted = isinstance(actual, int) and isinstance(most, int)
        return f"holds {actual:,} items; at most {most:,} are taken" if counted else "holds too many items"
    shown = repr(error.get("input"))
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{message[:1].lower()}{message[1:]}, got {shown}"


def _dotted(location: list[Any]) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def install_error_handlers(api: FastAPI, log: logging.Logger) -> None:
    """Has `api` answer every error in the API's shape: an APIError as it is, an unreadable body or an unknown
    route (Starlette's) as a refusal naming what was wrong, and any other exception as a 500, its traceback
    logged to `log`."""
    @api.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @api.exception_handler(RequestValidationError)
    async def unreadable(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = from_validation_errors(list(exc.errors()))
        content_type = request.headers.get("content-type", "")
        if error.param is None and "json" not in content_type.lower():  # FastAPI reads the body by this header
            error.message += (f" (it came as {content_type!r}" if content_type else " (it came with no Content-Type") \
                + "; send it with the header Content-Type: application/json)"
        return error.response()

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's, for what json.loads refused
            detail = "the request body could not be read as JSON (nested too deeply, or a number with too many digits?)"
            try:
                (await request.body()).decode("utf-8")
            except UnicodeDecodeError:
                detail = "the request body is not UTF-8 text, as JSON must be"
            except ClientDisconnect:  # the client left mid-body: nobody to answer
                detail = "the client went away before the body was sent"
        message = f"{request.method} {request.url.path}: {detail}"
        return APIError(exc.status_code, message, code=code).response()

    @api.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error answering %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}; the server's log has the details",
                        type="server_error").response()
