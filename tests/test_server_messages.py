"""The messages between the server's processes survive msgpack, and nothing else can be sent or rebuilt."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import pytest

from minisgl.core import SamplingParams
from minisgl.message import AbortBackendMsg, BatchBackendMsg, DetokenizeMsg, ExitMsg, UserMsg
from minisgl.message.frontend import AbortMsg, SchedulerStats, TokenizeMsg, TokenLogprob, UserReply
from minisgl.message.tokenizer import TokenStepMsg, pack_step, unpack_step
from minisgl.message.utils import deserialize, serialize

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, stop=["\n\n"], seed=3, logprobs=2)

MESSAGES = [
    UserMsg(1, [5, 6, 7], PARAMS),
    AbortBackendMsg(2),
    ExitMsg(),
    BatchBackendMsg([UserMsg(3, [1], SamplingParams()), AbortBackendMsg(4)]),
    DetokenizeMsg(5, 42, True, "stop", prompt_tokens=3, logprob=-0.5, top_logprobs=[[42, -0.5], [7, -1.5]]),
    DetokenizeMsg(6, -1, True, "error", "the prompt is empty; send at least one token"),
    TokenizeMsg([PARAMS], messages=[{"role": "user", "content": "héllo 🙂"}], uids=[7]),
    TokenizeMsg([PARAMS, SamplingParams(seed=2**64 - 1)], input_ids=[1, 2, 3], uids=[8, 9]),
    AbortMsg(9),
    UserReply(10, "text", False, logprobs=[TokenLogprob(42, "x", -0.5, [TokenLogprob(42, "x", -0.5)])]),
    SchedulerStats(running=3, waiting=1, kv_pages_total=100, kv_pages_held=12),
    TokenStepMsg([1, 2, 3], [40, 41, 42]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(msg: object) -> None:
    assert deserialize(serialize(msg)) == msg


def test_a_list_of_messages_round_trips() -> None:
    assert deserialize(serialize(MESSAGES)) == MESSAGES


def test_an_unknown_class_cannot_be_sent() -> None:
    @dataclass
    class Secret:
        value: int

    with pytest.raises(TypeError, match="Secret"):
        serialize(Secret(1))


def test_an_unknown_type_tag_is_refused_on_receipt() -> None:
    with pytest.raises(ValueError, match="unknown message type"):
        deserialize(msgpack.packb({"__msg__": "os.system", "command": "true"}))


def test_fields_at_their_defaults_do_not_travel_but_come_back() -> None:
    plain = DetokenizeMsg(5, 42, False)
    assert set(msgpack.unpackb(serialize(plain))) == {"__msg__", "uid", "next_token", "finished"}
    assert deserialize(serialize(plain)) == plain
    # a value equal to the default but of another type is not the default: it travels as it is
    odd = UserReply(1, "", False, prompt_tokens=False, cached_tokens=0.0)  # type: ignore[arg-type]
    back = deserialize(serialize(odd))
    assert back.prompt_tokens is False and type(back.cached_tokens) is float
    # a list left empty comes back as a new list of its own, not one shared with other messages
    a, b = deserialize(serialize([TokenizeMsg([PARAMS], text="x"), TokenizeMsg([PARAMS], text="y")]))
    assert a.uids == [] and a.uids is not b.uids


def test_a_step_travels_as_two_lists_of_plain_tokens_and_its_other_messages_whole() -> None:
    step = [
        DetokenizeMsg(1, 40, False),
        DetokenizeMsg(2, 41, False, logprob=-0.5, top_logprobs=[[41, -0.5]]),
        DetokenizeMsg(3, 42, False),
        DetokenizeMsg(4, 43, True, "length"),
        DetokenizeMsg(5, 44, False, prompt_tokens=9, cached_tokens=4),
        DetokenizeMsg(6, -1, True, "abort"),
        SchedulerStats(running=4),
    ]
    packed = deserialize(serialize(pack_step(step)))
    assert packed[0] == TokenStepMsg([1, 3], [40, 42]) and len(packed) == 6
    back = unpack_step(packed)
    key = lambda m: getattr(m, "uid", 99)  # noqa: E731
    assert sorted(back, key=key) == sorted([*step[:-1], SchedulerStats(running=4)], key=key)
    assert unpack_step(pack_step([DetokenizeMsg(7, -1, True, "error", "bad")])) == [
        DetokenizeMsg(7, -1, True, "error", "bad")
    ]
