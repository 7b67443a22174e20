"""msgpack (de)serialisation of the message dataclasses that cross process boundaries.

A dataclass travels as a map of its fields plus a type tag; only the classes named here can be
rebuilt, so a stray or hostile message cannot construct anything else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from minisgl.core import SamplingParams
from minisgl.message.backend import AbortBackendMsg, BatchBackendMsg, ExitMsg, FlushCacheMsg, UserMsg
from minisgl.message.frontend import (
    AbortMsg,
    SchedulerStats,
    TokenizeMsg,
    TokenLogprob,
    TokensMsg,
    TokensReply,
    UserReply,
)
from minisgl.message.tokenizer import DetokenizeMsg, FlushCacheReply, TokenStepMsg

_TAG = "__msg__"
_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        SamplingParams,
        UserMsg,
        AbortBackendMsg,
        ExitMsg,
        FlushCacheMsg,
        BatchBackendMsg,
        DetokenizeMsg,
        TokenStepMsg,
        FlushCacheReply,
        TokenizeMsg,
        AbortMsg,
        TokenLogprob,
        UserReply,
        SchedulerStats,
        TokensMsg,
        TokensReply,
    )
}


def _defaults(cls: type) -> list[tuple[str, Any]]:
    """Each field's name and the value it takes when left out (_REQUIRED where it has none)."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, f.default_factory()))
        else:
            out.append((f.name, _REQUIRED))
    return out


_REQUIRED = object()
# a field at its default is left out: a message of a token and a uid travels as three entries, not fourteen
_FIELDS: dict[type, list[tuple[str, Any]]] = {cls: _defaults(cls) for cls in _CLASSES.values()}


def _encode(obj: Any) -> dict[str, Any]:
    fields = _FIELDS.get(type(obj))
    if fields is None:
        raise TypeError(f"{type(obj).__name__} is not a message type that can be sent")
    out: dict[str, Any] = {_TAG: type(obj).__name__}
    for name, default in fields:
        value = getattr(obj, name)
        # `is` first: most fields hold the default object itself (None, 0, False)
        if value is default or (
            default is not _REQUIRED and type(value) is type(default) and value == default
        ):
            continue
        out[name] = value
    return out


def _decode(data: dict[str, Any]) -> Any:
    name = data.pop(_TAG, None)
    if name is None:
        return data
    if name not in _CLASSES:
        raise ValueError(f"unknown message type {name!r}")
    return _CLASSES[name](**data)


def serialize(obj: Any) -> bytes:
    """A message, or a list of messages, as bytes."""
    return msgpack.packb(obj, default=_encode)


def deserialize(data: bytes) -> Any:
    # logit_bias maps token ids (integers) to biases
    return msgpack.unpackb(data, object_hook=_decode, strict_map_key=False)
