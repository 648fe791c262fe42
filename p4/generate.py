"""Generator of the P4 files nobody edits by hand, and the check that they are up to date.

`luwu p4 generate [--lanes N]` writes:
  p4/include/constants.p4          from luwu.dataplane.protocol
  p4/include/payload.p4            the LANES-field payload header     (templates/payload.p4)
  p4/include/aggregation_lanes.p4  one register per lane, v1model     (templates/aggregation_lanes.p4)
  p4/tna/aggregation_lanes.p4      one register per lane, TNA         (templates/tna_aggregation_lanes.p4)
  p4/build/p4info.txtpb            P4Info of p4/luwu_v1model.p4, derived from the sources
  p4/runtime/star4.json            the example runtime config (luwu.p4.runtime_examples)
`luwu p4 check` regenerates in memory with the committed lane count and reports stale files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from luwu.dataplane.protocol import PACKET_MODES

from . import BUILD_DIR, P4_DIR, P4INFO_TXTPB
from .codegen import constants_p4, render_lanes

DEFAULT_LANES = PACKET_MODES["tofino"]
V1MODEL_PROGRAM = P4_DIR / "luwu_v1model.p4"
TNA_PROGRAM = P4_DIR / "luwu_tna.p4"
PAYLOAD_P4 = P4_DIR / "include" / "payload.p4"

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


def render_all(lanes: int = DEFAULT_LANES) -> dict[Path, str]:
    """Text of every generated file for `lanes` lanes, P4Info last (it reads the others)."""
    if lanes < 1:
        raise ValueError(f"lane count must be >= 1, got {lanes}")
    files: dict[Path, str] = {P4_DIR / "include" / "constants.p4": constants_p4()}
    for path, template in LANE_FILES.items():
        if template.startswith("tna_") and lanes % 2:
            # TNA keeps two lanes per register; an odd build still generates the v1model files.
            files[path] = (f'#error "the TNA program pairs lanes: regenerate with an even --lanes (got {lanes})"\n')
            continue
        files[path] = render_lanes(template, lanes)
    from .p4info import p4info_text  # protobuf is only needed here

    files[P4INFO_TXTPB] = p4info_text(V1MODEL_PROGRAM, overrides=files)
    from .runtime_examples import STAR_FILE, star_runtime

    files[P4_DIR / "runtime" / STAR_FILE] = star_runtime().dumps()
    return files


def generate(lanes: int = DEFAULT_LANES) -> list[Path]:
    """Write every generated file; returns the paths that changed. Validates the P4Info."""
    files = render_all(lanes)
    validate_p4info_text(files[P4INFO_TXTPB])
    from .runtime_config import RuntimeConfig
    from .runtime_examples import STAR_FILE

    RuntimeConfig.from_dict(json.loads(files[P4_DIR / "runtime" / STAR_FILE])).validate(
        _p4info_message(files[P4INFO_TXTPB]))
    changed = []
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def check(lanes: int | None = None) -> list[Stale]:
    """Generated files that differ from what `generate` would write (empty: all up to date)."""
    files = render_all(committed_lanes() if lanes is None else lanes)
    stale = []
    for path, text in files.items():
        if not path.exists():
            stale.append(Stale(path, "missing"))
        elif path.read_text() != text:
            stale.append(Stale(path, "differs from its sources"))
    return stale


def validate_p4info_text(text: str) -> None:
    """Load the P4Info the way controllers will (finsy.P4Schema); raises on any problem."""
    import tempfile

    from finsy import P4Schema

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p4info.txtpb"
        path.write_text(text)
        schema = P4Schema(path)
        if not schema.tables or not schema.actions:
            raise ValueError("generated P4Info has no tables or actions")


def _p4info_message(text: str):
    from finsy.proto import p4i
    from google.protobuf import text_format

    return text_format.Parse(text, p4i.P4Info())
