"""StarPlan <-> JSON, for the c10d store and the switch host's stdin (no pickles cross processes)."""

from __future__ import annotations

import dataclasses
import json

from luwu.dataplane.loopback import StarPlan


def star_plan_to_dict(plan: StarPlan) -> dict:
    d = dataclasses.asdict(plan)
    d["switch_ports"] = {str(k): list(v) for k, v in plan.switch_ports.items()}
    return d


def star_plan_to_json(plan: StarPlan) -> str:
    return json.dumps(star_plan_to_dict(plan))


def star_plan_from_dict(d: dict) -> StarPlan:
    names = {f.name for f in dataclasses.fields(StarPlan)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"not a StarPlan: unknown keys {sorted(unknown)} (expected {sorted(names)})")
    kw = dict(d)
    kw["switch_ports"] = {int(k): (str(v[0]), int(v[1])) for k, v in d.get("switch_ports", {}).items()}
    return StarPlan(**kw)


def star_plan_from_json(text: str) -> StarPlan:
    return star_plan_from_dict(json.loads(text))
