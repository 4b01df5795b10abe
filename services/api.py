"""The HTTP contract of the Serve application: request and response bodies (pydantic, strict:
an unknown field or a non-integer id is a 422 naming it) and the 422 the handlers raise.

No "from __future__ import annotations": FastAPI resolves these annotations at runtime.
"""

from typing import Annotated

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictInt

# ids are int64 everywhere (datasets, states, the store): larger ones are refused at the door
ID_MAX = 2**63 - 1

ItemId = Annotated[StrictInt, Field(ge=-ID_MAX - 1, le=ID_MAX)]


class RankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictInt = Field(
        ge=0, le=ID_MAX, description="a user id (int64); unknown users rank from no history"
    )
    candidate_item_ids: list[ItemId] = Field(min_length=1, description="distinct item ids")
    k: StrictInt = Field(default=10, ge=1, description="how many of the best to return")
    skip_unknown: bool = Field(
        default=False,
        description="rank the known candidates and list the unknown ones in the answer "
        "(default: an unknown candidate fails the request with 422)",
    )


class RecommendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictInt = Field(
        ge=0,
        le=ID_MAX,
        description="a user id (int64); unknown users get recommendations from no history",
    )
    k: StrictInt = Field(default=10, ge=1, description="how many of the best to return")
    exclude_seen: bool = Field(
        default=True,
        description="leave out the items of the user's stored history (the newest items "
        "their state holds: the ranker's window plus state_slack_items)",
    )


class ScoredItem(BaseModel):
    item_id: int
    score: float


class RankResponse(BaseModel):
    user_id: int
    known_user: bool
    history_length: int
    items: list[ScoredItem]
    unknown_item_ids: list[int] = Field(
        default_factory=list, description="with skip_unknown: the candidates not in the catalog"
    )
    note: str | None = None


class EventRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="the client's idempotency key: an event sent again with the same id (a "
        "retry) is applied once and gets the first answer",
    )
    user_id: StrictInt = Field(ge=0, le=ID_MAX)
    item_id: ItemId
    feedback: StrictInt = Field(
        default=-1,
        ge=-1,
        le=2**31 - 1,
        description="feedback class: -1 unknown, else 0 .. the model's feedback classes - 1 "
        "(GET /v1/stats gives the count)",
    )


class EventResponse(BaseModel):
    user_id: int
    history_length: int
    state_bytes: int
    acknowledged: bool = True
    duplicate: bool = Field(
        default=False, description="the event_id was applied before: this is its first answer"
    )


class UserResponse(BaseModel):
    user_id: int
    known_user: bool
    history_length: int
    state_bytes: int


def bad_request(field: str, message: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[{"loc": ["body", field], "msg": message}])
