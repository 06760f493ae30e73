"""What the `/v1/messages` and `/v1/responses` translations share: refusing unknown request fields, and
Server-Sent Events with an `event:` line.

Both APIs grow new fields often, and a client that sends one expects it to matter. Their request models accept
any field (pydantic `extra="allow"`), and `refuse_unknown_fields` then answers 400 for each unknown field that is
not on the model's `harmless_fields` list (fields that cannot change the answer: billing tags, cache hints, ids).
A field sent as null, `[]` or `{}` asks for nothing and is accepted.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

from cortexstream.server.errors import APIError

T = TypeVar("T")


class OpenModel(BaseModel):
    """A request model that keeps unknown fields so `refuse_unknown_fields` can judge them."""

    model_config = ConfigDict(extra="allow")
    harmless_fields: ClassVar[tuple[str, ...]] = ()


def _asks_for_nothing(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def refuse_unknown_fields(model: BaseModel, path: str = "") -> None:
    """APIError(400) naming the first unknown, non-harmless field of `model` or of any model inside it."""
    harmless = model.harmless_fields if isinstance(model, OpenModel) else ()
    for name, value in (model.model_extra or {}).items():
        if name not in harmless and not _asks_for_nothing(value):
            where = _join(path, name)
            raise APIError(400, f"{where}: not supported by this server (it would change the answer, so it is "
                                "refused rather than ignored); leave the field out",
                           param=where, code="unsupported_parameter")
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            refuse_unknown_fields(value, _join(path, name))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    refuse_unknown_fields(item, f"{_join(path, name)}[{index}]")


def bad_request(where: str, message: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where)


def as_api_error(build: Callable[[], T], where: str | None = None) -> T:
    """`build()`, with a ValueError (a dataclass's check, whose message starts with its field) turned into a 400."""
    try:
        return build()
    except ValueError as exc:
        head = str(exc).split(":", 1)[0].strip()
        param = where or (head if re.fullmatch(r"[\w.\[\]]+", head) else None)
        raise APIError(400, str(exc), param=param) from exc


def typed_sse(event_type: str, payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event with an `event:` line, as both Anthropic's and the Responses API's streams send."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event_type}\ndata: {data}\n\n".encode()


def discriminate_by_type(known: tuple[str, ...] | dict[str, str], other: str = "other") -> Callable[[Any], str]:
    """A pydantic discriminator: the tag of the item's `type` (`known` maps types to tags; a tuple tags each type by
    itself), else `other`: a catch-all model that lets the translation refuse the item by name instead of failing
    validation with a vague union error."""
    tags = known if isinstance(known, dict) else {kind: kind for kind in known}

    def tag(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind, other) if isinstance(kind, str) else other

    return tag
