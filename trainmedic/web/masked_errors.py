"""The API's error answers, masked: no secret leaves in an error body (schemas/masking.py).

An error's detail is often built from an exception or a URL (a bundle's 404 names the audit
it searched), and any token holder, a read-only one too, reads it. `mask_errors(app)` puts
every HTTPException (404 of an unknown route too) and every validation error through
`schemas.masking.mask` before it is sent; an unexpected exception answers Starlette's bare 500
and its traceback goes to the log, which the process's logging masks.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.masking import mask


def masked(value: Any) -> Any:
    """A JSON-ready value with every string in it masked."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {k: masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [masked(v) for v in value]
    return value


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return await http_exception_handler(
        request, StarletteHTTPException(exc.status_code, masked(exc.detail), getattr(exc, "headers", None))
    )


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": masked(jsonable_encoder(exc.errors()))})


def mask_errors(app: FastAPI) -> FastAPI:
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    return app
