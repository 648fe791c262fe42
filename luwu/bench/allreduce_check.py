"""The inputs of `luwu bench allreduce` and the check of its sums: every rank's buffer from a
seed (`inputs`), and a result compared element by element with the exact sum of them (`verify`).
Shared by the engine runs (allreduce.py) and the runs through torch (torch_sweep.py).
"""

from __future__ import annotations

import numpy as np


def inputs(rank: int, numel: int, dtype: str, seed: int = 1234) -> np.ndarray:
    """Rank `rank`'s buffer of `numel` elements: int32 over the whole range (sums wrap), or float32
    normals scaled by a per-rank power of ten in 1e-3..1e3 (per-chunk exponents must differ)."""
    rng = np.random.default_rng(seed + rank)
    if dtype == "int32":
        return rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32)
    scale = np.float32(10.0 ** rng.uniform(-3, 3))
    return (rng.standard_normal(numel, dtype=np.float32) * scale).astype(np.float32)


def verify(result: np.ndarray, n: int, numel: int, dtype: str, lanes: int, grad_format: str | None = None) -> dict:
    """Check `result` against the exact sum of `n` ranks' `inputs`: int32 bit-exact (wrapping),
    float32 within the bound of the wire format the sum took (`grad_format`, default the one
    `LUWU_GRAD_FORMAT` gives the engines): FIXED32 `quantize.error_bound` of its chunks'
    exponents (`lanes` per chunk), FIXED16 `quantize.error_bound16` of its blocks' (docs/protocol.md
    5.2). Returns {"checked", "mismatches", "max_error_over_bound"}."""
    from luwu.dataplane.engine.config import check_grad_format, grad_format_from_env
    from luwu.dataplane.integrity import FIXED16_BLOCK
    from luwu.dataplane.quantize import block_exponents, chunk_exponents, error_bound, error_bound16

    xs = [inputs(r, numel, dtype) for r in range(n)]
    if dtype == "int32":
        expected = xs[0].copy()
        for x in xs[1:]:
            expected += x  # wraps like the switch
        bad = int((result != expected).sum())
        return {"checked": numel, "mismatches": bad, "max_error_over_bound": 0.0 if not bad else float("inf")}
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    if check_grad_format(grad_format or grad_format_from_env()) == "fixed16":
        exps = np.max([block_exponents(x, FIXED16_BLOCK) for x in xs], axis=0) if numel else np.zeros(0, np.int32)
        bound = error_bound16(result, exps, FIXED16_BLOCK, n)
    else:
        exps = np.max([chunk_exponents(x, lanes) for x in xs], axis=0) if numel else np.zeros(0, np.int32)
        bound = error_bound(result, exps, lanes, n)
    err = np.abs(result.astype(np.float64) - exact)
    ratio = float((err / np.maximum(bound, 1e-300)).max()) if numel else 0.0
    return {"checked": numel, "mismatches": int((err > bound).sum()), "max_error_over_bound": ratio}
