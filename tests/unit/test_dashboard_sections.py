"""A dashboard section sends a viewer only the rows that changed since its last frame, and
the order of the rows when that changed; a viewer that skipped rounds gets all it missed."""

from __future__ import annotations

import json

from gateway.dashboard.sections import KEY_OF, Section


def _jobs(*rows: tuple[str, str]) -> list[dict[str, str]]:
    return [{"id": i, "status": s} for i, s in rows]


def test_only_changed_rows_and_a_changed_order_are_sent() -> None:
    s = Section(KEY_OF["jobs"])
    s.update(_jobs(("a", "queued"), ("b", "queued")), version=1)
    first = json.loads(s.since(0) or "")
    assert first["order"] == ["a", "b"] and set(first["rows"]) == {"a", "b"}

    s.update(_jobs(("a", "running"), ("b", "queued")), version=2)
    assert json.loads(s.since(1) or "") == {"rows": {"a": {"id": "a", "status": "running"}}}

    s.update(_jobs(("a", "running"), ("b", "queued")), version=3)
    assert s.since(2) is None  # nothing changed: the section is left out of the frame

    s.update(_jobs(("c", "queued"), ("a", "running")), version=4)  # b went, c came
    assert json.loads(s.since(3) or "") == {
        "order": ["c", "a"],
        "rows": {"c": {"id": "c", "status": "queued"}},
    }
    missed = json.loads(s.since(1) or "")  # a viewer that skipped rounds 2 and 3
    assert missed["order"] == ["c", "a"] and set(missed["rows"]) == {"a", "c"}
    assert json.loads(s.listing()) == _jobs(("c", "queued"), ("a", "running"))


def test_an_empty_section_is_named_in_a_first_frame() -> None:
    s = Section(KEY_OF["workers"])
    s.update([], version=1)
    assert json.loads(s.since(0) or "") == {"order": []}
    assert s.since(1) is None
