"""The software switch's table schema read through its P4Info facts cache (table_schema.py): the
cached facts give the same schema as parsing the P4Info with protobuf, a corrupt or stale cache
file is parsed again (never a wrong schema), and a P4Info the twin cannot run is still refused."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from luwu.dataplane.switch import table_schema as ts
from luwu.p4 import P4INFO_TXTPB


def _cache_files() -> list[str]:
    return glob.glob(os.path.join(os.path.dirname(ts.__file__), "__pycache__", "p4info-facts-*.json"))


def test_cached_facts_give_the_parsed_schema():
    parsed = ts._load_schema(ts._p4info_facts(P4INFO_TXTPB.read_text()))
    assert ts._load_schema() == parsed == ts.SCHEMA
    assert [s.doc for s in parsed.values()] == [s.doc for s in ts.SCHEMA.values()]  # doc is not compared
    assert {"sessions", "workers", "endpoints", "ipv4_lpm"} <= set(parsed)


def test_a_fresh_process_reads_the_cache_without_protobuf():
    ts._cached_facts()  # writes it when missing
    assert _cache_files(), "no facts cache was written next to table_schema.py"
    code = ("import sys; from luwu.dataplane.switch import table_schema as ts; "
            "print(len(ts.SCHEMA), 'finsy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(len(ts.SCHEMA)), "False"]


@pytest.mark.parametrize("garbage", ["{not json", json.dumps({"version": -1, "tables": []}), "[]"])
def test_a_corrupt_or_stale_cache_is_parsed_again(garbage):
    ts._cached_facts()
    files = _cache_files()
    saved = {p: open(p).read() for p in files}
    try:
        for p in files:
            with open(p, "w") as f:
                f.write(garbage)
        assert ts._load_schema() == ts.SCHEMA
    finally:
        for p, text in saved.items():
            with open(p, "w") as f:
                f.write(text)


def test_an_unsupported_match_kind_is_refused():
    facts = ts._p4info_facts(P4INFO_TXTPB.read_text())
    facts["tables"][0]["keys"][0][2] = "TERNARY"
    with pytest.raises(ts.TableError, match="match kind TERNARY"):
        ts._load_schema(facts)
