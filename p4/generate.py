"""Generator of the P4 files nobody edits by hand, and the check that they are up to date.

`luwu p4 generate [--lanes N]` writes:
  p4/include/constants.p4          from luwu.dataplane.protocol
  p4/include/payload.p4            the LANES-field payload header     (templates/payload.p4)
  p4/include/aggregation_lanes.p4  one register per lane, v1model     (templates/aggregation_lanes.p4)
  p4/tna/aggregation_lanes.p4      two lanes per register, TNA        (templates/tna_aggregation_lanes.p4)
then, when p4c is on PATH, compiles p4/luwu_v1model.p4 into the committed build (luwu.p4.compiler:
p4/build/p4info.txtpb, p4/build/luwu_v1model.json, p4/build/build-info.json), and last
  p4/runtime/star4.json            the example runtime config (luwu.p4.runtime_examples)
`luwu p4 check` regenerates the sources in memory with the committed lane count and reports stale
files, including a build whose stamp does not match the sources (no compiler needed for that).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from luwu.dataplane.protocol import PACKET_MODES

from . import P4_DIR, P4INFO_TXTPB
from .codegen import constants_p4, render_lanes
from .compiler import INSTALL_HINT, build_staleness, p4c_available, rebuild, rel

DEFAULT_LANES = PACKET_MODES["tofino"]
PAYLOAD_P4 = P4_DIR / "include" / "payload.p4"
RUNTIME_DIR = P4_DIR / "runtime"

# generated path -> template (None: constants from protocol.py)
LANE_FILES = {
    P4_DIR / "include" / "payload.p4": "payload.p4",
    P4_DIR / "include" / "aggregation_lanes.p4": "aggregation_lanes.p4",
    P4_DIR / "tna" / "aggregation_lanes.p4": "tna_aggregation_lanes.p4",
}


@dataclass
class Stale:
    path: Path
    reason: str


def committed_lanes() -> int:
    """Lane count of the committed payload.p4 (what `check` regenerates with)."""
    if not PAYLOAD_P4.exists():
        return DEFAULT_LANES
    m = re.search(r"^#define LANES (\d+)$", PAYLOAD_P4.read_text(), re.M)
    if not m:
        raise ValueError(f"{PAYLOAD_P4} has no `#define LANES n` line: regenerate it with `luwu p4 generate`")
    return int(m.group(1))


def render_sources(lanes: int = DEFAULT_LANES) -> dict[Path, str]:
    """Text of every generated P4 source for `lanes` lanes."""
    if lanes < 1:
        raise ValueError(f"lane count must be >= 1, got {lanes}")
    files: dict[Path, str] = {P4_DIR / "include" / "constants.p4": constants_p4()}
    for path, template in LANE_FILES.items():
        if template.startswith("tna_") and lanes % 2:
            # TNA keeps two lanes per register; an odd build still generates the v1model files.
            files[path] = (f'#error "the TNA program pairs lanes: regenerate with an even --lanes (got {lanes})"\n')
            continue
        files[path] = render_lanes(template, lanes)
    return files


def render_runtime() -> dict[Path, str]:
    """The example runtime config, validated against the committed P4Info."""
    from luwu.dataplane.p4runtime.entries import P4InfoIndex, RuntimeConfig

    from .runtime_examples import STAR_FILE, star_runtime

    text = star_runtime().dumps()
    RuntimeConfig.from_dict(json.loads(text)).validate(P4InfoIndex.load(P4INFO_TXTPB))
    return {RUNTIME_DIR / STAR_FILE: text}


def _write(files: dict[Path, str]) -> list[Path]:
    changed = []
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def generate(lanes: int = DEFAULT_LANES, compile: bool = True) -> tuple[list[Path], list[str]]:
    """Write the generated sources, rebuild with p4c when it is installed, write the runtime example.

    Returns:
        (paths that changed, notes for the user: p4c's warnings, or why the build was not redone).
    """
    changed = _write(render_sources(lanes))
    notes: list[str] = []
    if compile and p4c_available():
        result = rebuild()
        notes.extend(f"p4c: {w}" for w in result.warnings)
    elif build_staleness():
        notes.append(f"p4c is not on PATH: the committed build ({rel(P4INFO_TXTPB.parent)}) is stale; {INSTALL_HINT}")
    changed += _write(render_runtime())
    return changed, notes


def check(lanes: int | None = None) -> list[Stale]:
    """Generated files that differ from what `generate` would write (empty: all up to date)."""
    files = render_sources(committed_lanes() if lanes is None else lanes)
    stale = []
    for reason in build_staleness():
        stale.append(Stale(P4INFO_TXTPB.parent, reason))
    if not stale:
        files.update(render_runtime())
    for path, text in files.items():
        if not path.exists():
            stale.append(Stale(path, "missing"))
        elif path.read_text() != text:
            stale.append(Stale(path, "differs from its sources"))
    return stale
