"""The stream keys of XREADGROUP and XREAD, found without asking the server (shared/redisconn.py):
redis-py's cluster client sent a COMMAND GETKEYS before every such read."""

from __future__ import annotations

from shared.redisconn import stream_keys


def test_the_keys_are_those_after_streams_the_first_half() -> None:
    read = (
        "XREADGROUP",
        "GROUP",
        "g",
        "c",
        "COUNT",
        5,
        "BLOCK",
        100,
        "STREAMS",
        "a",
        "b",
        ">",
        ">",
    )
    assert stream_keys(read) == ("a", "b")
    assert stream_keys((b"XREAD", b"COUNT", b"1", b"STREAMS", b"k", b"0")) == ("k",)
    assert stream_keys(("xreadgroup", "GROUP", "g", "c", "NOACK", "STREAMS", "k", ">")) == ("k",)


def test_a_group_or_consumer_named_streams_is_not_the_keyword() -> None:
    read = ("XREADGROUP", "GROUP", "streams", "STREAMS", "STREAMS", "k", ">")
    assert stream_keys(read) == ("k",)


def test_other_commands_and_odd_shapes_are_left_to_the_server() -> None:
    assert stream_keys(("GET", "k")) is None
    assert stream_keys(()) is None
    assert stream_keys(("XREADGROUP", "GROUP", "g", "c", "STREAMS", "a", ">", "x")) is None
    assert stream_keys(("XREADGROUP", "GROUP", "g", "c", "SOMETHING", "STREAMS", "a", ">")) is None
    assert stream_keys(("XREAD", "COUNT")) is None
