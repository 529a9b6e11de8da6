"""The OpenAI Files and Batches API: /v1/files and /v1/batches. Thin: the work is
FileService's and BatchService's (gateway/batch/runtime.py holds them)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse

from gateway.batch.files import FileService
from gateway.batch.runtime import BatchRuntime
from gateway.batch.service import BatchService, CreateBatch
from gateway.body_scan import CountedListsRoute
from gateway.deps import Authorized, Caller, RateLimited
from gateway.http_errors import error_responses
from shared.batches import (
    BATCH_ID,
    FILE_ID,
    BatchObject,
    FileDeleted,
    FileObject,
    FilePurpose,
    ObjectList,
)

router = APIRouter(
    prefix="/v1",
    tags=["batch"],
    route_class=CountedListsRoute,
    dependencies=[Authorized, RateLimited],
    responses=error_responses(400, 401, 404, 409, 413, 422, 429, 503),
)
# No pattern on the ids: a malformed one names no file or batch, so it is the same 404 as an
# unknown one (the services check the form before any lookup), not a 422.
FileId = Annotated[str, Path(description="file-<32 hex>")]
BatchId = Annotated[str, Path(description="batch_<32 hex>")]
AfterFile = Annotated[
    str | None, Query(pattern=f"^{FILE_ID.pattern}$", description="the last id of the page before")
]
AfterBatch = Annotated[
    str | None, Query(pattern=f"^{BATCH_ID.pattern}$", description="the last id of the page before")
]

MAX_FILES_PAGE = 10_000
MAX_BATCHES_PAGE = 100
DEFAULT_BATCHES_PAGE = 20
"""OpenAI's page sizes."""


def _runtime(request: Request) -> BatchRuntime:
    runtime: BatchRuntime = request.app.state.batch
    return runtime


def get_files(request: Request) -> FileService:
    return _runtime(request).files


def get_batches(request: Request) -> BatchService:
    return _runtime(request).batches


Files = Annotated[FileService, Depends(get_files)]
Batches = Annotated[BatchService, Depends(get_batches)]


@router.post("/files")
async def upload_file(request: Request, files: Files, caller: Caller) -> FileObject:
    """Multipart: `file` (JSON lines) and `purpose` ("batch"); optional `expires_after`."""
    return await files.upload(request, caller)


@router.get("/files")
async def list_files(
    files: Files,
    caller: Caller,
    after: AfterFile = None,
    limit: Annotated[int, Query(ge=1, le=MAX_FILES_PAGE)] = MAX_FILES_PAGE,
    order: Literal["asc", "desc"] = "desc",
    purpose: FilePurpose | None = None,
) -> ObjectList:
    return await files.listing(
        caller, after=after, limit=limit, newest_first=order == "desc", purpose=purpose
    )


@router.get("/files/{file_id}")
async def get_file(file_id: FileId, files: Files, caller: Caller) -> FileObject:
    return await files.get(file_id, caller)


@router.get("/files/{file_id}/content")
async def file_content(file_id: FileId, files: Files, caller: Caller) -> StreamingResponse:
    content = await files.content(file_id, caller)
    return StreamingResponse(content, media_type="application/octet-stream")


@router.delete("/files/{file_id}")
async def delete_file(file_id: FileId, files: Files, caller: Caller) -> FileDeleted:
    return await files.delete(file_id, caller)


@router.post("/batches")
async def create_batch(body: CreateBatch, batches: Batches, caller: Caller) -> BatchObject:
    return await batches.create(body, caller)


@router.get("/batches")
async def list_batches(
    batches: Batches,
    caller: Caller,
    after: AfterBatch = None,
    limit: Annotated[int, Query(ge=1, le=MAX_BATCHES_PAGE)] = DEFAULT_BATCHES_PAGE,
) -> ObjectList:
    return await batches.listing(caller, after=after, limit=limit)


@router.get("/batches/{batch_id}")
async def get_batch(batch_id: BatchId, batches: Batches, caller: Caller) -> BatchObject:
    return await batches.get(batch_id, caller)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: BatchId, batches: Batches, caller: Caller) -> BatchObject:
    return await batches.cancel(batch_id, caller)
