"""msgpack (de)serialisation of the message dataclasses that cross process boundaries.

A dataclass travels as a map of its fields plus a type tag; only the classes named here can be
rebuilt, so a stray or hostile message cannot construct anything else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from minisgl.core import SamplingParams
from minisgl.message.backend import AbortBackendMsg, BatchBackendMsg, ExitMsg, UserMsg
from minisgl.message.frontend import (
    AbortMsg,
    SchedulerStats,
    TokenizeMsg,
    TokenLogprob,
    TokensMsg,
    TokensReply,
    UserReply,
)
from minisgl.message.tokenizer import DetokenizeMsg

_TAG = "__msg__"
_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        SamplingParams,
        UserMsg,
        AbortBackendMsg,
        ExitMsg,
        BatchBackendMsg,
        DetokenizeMsg,
        TokenizeMsg,
        AbortMsg,
        TokenLogprob,
        UserReply,
        SchedulerStats,
        TokensMsg,
        TokensReply,
    )
}


def _encode(obj: Any) -> dict[str, Any]:
    cls = type(obj)
    if cls.__name__ not in _CLASSES or _CLASSES[cls.__name__] is not cls:
        raise TypeError(f"{cls.__name__} is not a message type that can be sent")
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    out[_TAG] = cls.__name__
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
