"""A section of the dashboard (models, queues, workers, jobs, batches) as rows with versions,
so that a viewer is sent only the rows that changed since its last frame.

Each row is encoded once per change, for every viewer; its version is the round it last
changed in. The order of the rows (their keys) has a version of its own. A viewer's frame
holds, per section, the rows newer than what it was sent and the order if that is newer:
`{"order": [key, …], "rows": {key: row}}` (either may be absent). The page keeps the rows
it was sent and shows those the order names, in its order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Row = dict[str, Any]
KEY_OF: dict[str, Callable[[Row], str]] = {
    "models": lambda r: str(r["name"]),
    "queues": lambda r: f"{r['model']}:{r['priority']}",
    "workers": lambda r: str(r["id"]),
    "jobs": lambda r: str(r["id"]),
    "batches": lambda r: str(r["id"]),
}
SECTIONS = tuple(KEY_OF)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(slots=True)
class Section:
    key_of: Callable[[Row], str]
    rows: dict[str, tuple[int, str]] = field(default_factory=dict)
    """key → (version, the row's JSON)."""
    order: list[str] = field(default_factory=list)
    order_version: int = 0

    def update(self, values: list[Row], version: int) -> None:
        keyed = {self.key_of(v): v for v in values}
        order = list(keyed)
        if order != self.order:
            self.order, self.order_version = order, version
        rows: dict[str, tuple[int, str]] = {}
        for key, value in keyed.items():
            text = _json(value)
            old = self.rows.get(key)
            rows[key] = old if old is not None and old[1] == text else (version, text)
        self.rows = rows

    def since(self, version: int) -> str | None:
        """The JSON a viewer sent everything up to `version` needs; None: nothing new."""
        parts = []
        if self.order_version > version or version == 0:  # a first frame names every section
            parts.append(f'"order":{_json(self.order)}')
        changed = [f"{_json(k)}:{text}" for k, (v, text) in self.rows.items() if v > version]
        if changed:
            parts.append('"rows":{' + ",".join(changed) + "}")
        return "{" + ",".join(parts) + "}" if parts else None

    def listing(self) -> str:
        """The rows in order, as one JSON list (the snapshot's form)."""
        return "[" + ",".join(self.rows[k][1] for k in self.order) + "]"
