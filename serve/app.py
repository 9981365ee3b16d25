"""The HTTP routes: OpenAI's Files and Batches endpoints under ``/v1``, with bearer auth.

Every route but ``/health`` needs a key; a missing or wrong key is a 401 whose message never
quotes what was sent. A key sees only its own files and batches: anything else is a 404, the
same answer as for an id that does not exist.
"""

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvbatch.serve.auth import ANONYMOUS, ApiKeys, bearer_token
from kvbatch.serve.batches import BatchService
from kvbatch.serve.errors import ApiError
from kvbatch.serve.files import FileService
from kvbatch.serve.objects import CreateBatch

MULTIPART_OVERHEAD = 1 << 20  # room for the form's boundaries and headers around the file itself
UNAUTHORIZED = ("Incorrect or missing API key. Send 'Authorization: Bearer <key>' with a key listed in "
                "KVBATCH_API_KEYS.")


def _owner_dependency(keys: ApiKeys | None) -> Callable[[Request], str]:
    def owner(request: Request) -> str:
        if keys is None:  # --insecure-no-auth
            return ANONYMOUS
        token = bearer_token(request.headers.get("authorization"))
        found = keys.owner_of(token) if token else None
        if found is None:
            raise ApiError(401, UNAUTHORIZED, code="invalid_api_key")
        return found

    return owner


# A request field this server does not act on (one OpenAI adds after this server was written, say) is refused,
# never ignored: the caller would believe it took effect.
UNSUPPORTED_FIELD = "not supported by this server (a field it does not act on is refused, not ignored)"


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "form")]
    field = ".".join(loc) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = UNSUPPORTED_FIELD
    return (f"{field}: {msg}" if field else msg), field


def create_app(files: FileService, batches: BatchService, keys: ApiKeys | None) -> FastAPI:
    """``keys=None`` serves without auth (``--insecure-no-auth``): everything is one owner's."""
    app = FastAPI(title="kvbatch: OpenAI Files + Batches API", docs_url=None, redoc_url=None)
    Owner = Annotated[str, Depends(_owner_dependency(keys))]

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(list(exc.errors()))
        return JSONResponse(ApiError(400, message, param=field).body(), status_code=400)

    @app.middleware("http")
    async def _refuse_oversized_uploads(request: Request, call_next: Callable) -> Any:
        """An upload whose declared size is over the limit is refused before a byte of it is read
        (the multipart parser would otherwise spool all of it to disk first); one that does not
        declare its size is counted as it is copied (``FileService.upload``)."""
        if request.method == "POST" and request.url.path == "/v1/files":
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > files.settings.max_file_bytes + MULTIPART_OVERHEAD:
                return JSONResponse(files.too_large(int(declared)).body(), status_code=400)
        return await call_next(request)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/files")
    def upload_file(owner: Owner, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict:
        return files.upload(owner, file.filename or "upload.jsonl", purpose, file.file).model_dump()

    @app.get("/v1/files")
    def list_files(owner: Owner, purpose: str | None = None) -> dict:
        data = [f.model_dump() for f in files.list(owner, purpose)]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}

    @app.get("/v1/files/{file_id}")
    def get_file(owner: Owner, file_id: str) -> dict:
        return files.get(owner, file_id).model_dump()

    @app.get("/v1/files/{file_id}/content")
    def file_content(owner: Owner, file_id: str) -> StreamingResponse:
        files.get(owner, file_id)  # 404 before the response starts
        return StreamingResponse(files.read(owner, file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(owner: Owner, file_id: str) -> dict:
        return files.delete(owner, file_id)

    @app.post("/v1/batches")
    async def create_batch(owner: Owner, request: Request) -> dict:
        try:
            body = CreateBatch.model_validate_json(await request.body())
        except ValidationError as exc:
            message, field = _validation_message(list(exc.errors(include_url=False)))
            raise ApiError(400, message, param=field) from None
        return batches.create(owner, body).model_dump()

    @app.get("/v1/batches")
    def list_batches(owner: Owner, after: str | None = None, limit: Annotated[int, Query()] = 20) -> dict:
        return batches.list(owner, after, limit)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(owner: Owner, batch_id: str) -> dict:
        return batches.get(owner, batch_id).model_dump()

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(owner: Owner, batch_id: str) -> dict:
        return batches.cancel(owner, batch_id).model_dump()

    return app
