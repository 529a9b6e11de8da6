"""`GET /v1/models`: the models some live worker serves, in OpenAI's list shape."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fastapi import APIRouter

from gateway.deps import Authorized, State
from gateway.http_errors import error_responses
from shared.errors import NotFound, shown
from shared.records import Heartbeat

router = APIRouter(
    prefix="/v1/models",
    tags=["models"],
    dependencies=[Authorized],
    responses=error_responses(401, 422, 503),
)


async def _served(state: State) -> dict[str, list[Heartbeat]]:
    by_model: dict[str, list[Heartbeat]] = defaultdict(list)
    for hb in await state.registry.live_workers():
        by_model[hb.model].append(hb)
    return by_model


async def _entry(state: State, name: str, beats: list[Heartbeat]) -> dict[str, Any]:
    card = (await state.registry.get(name)).card
    return {
        "id": name,
        "object": "model",
        "created": int(min(b.started_at for b in beats)),
        "owned_by": "genq",
        "engine": card.engine,
        "simulated": card.simulated,
        "max_model_len": card.max_seq_len,
        "workers": len(beats),
        "capacity": sum(b.capacity for b in beats),
        "active": sum(b.active for b in beats),
    }


@router.get("")
async def list_models(state: State) -> dict[str, Any]:
    served = await _served(state)
    return {
        "object": "list",
        "data": [await _entry(state, m, b) for m, b in sorted(served.items())],
    }


@router.get("/{model}", responses=error_responses(404))
async def get_model(model: str, state: State) -> dict[str, Any]:
    beats = (await _served(state)).get(model)
    if not beats:
        raise NotFound(
            f"no live worker serves model {shown(model)}", param="model", code="model_not_found"
        )
    return await _entry(state, model, beats)
