"""parallel/demix_sync.py's docstring table is `SYNC_TABLE` (tests/multirank/test_sync_table.py checks the rows
against a real step)."""

from __future__ import annotations

import parallel.demix_sync as demix_sync
from tests.harness.sync_table import sync_rows, sync_table


def test_the_docstring_table_is_the_sync_table():
    assert sync_table() in demix_sync.__doc__, (
        "parallel/demix_sync.py's docstring table differs from SYNC_TABLE: paste the output of "
        "tests.harness.sync_table.sync_table() into it"
    )


def test_sync_rows_pick_the_stage_and_kind():
    dense0 = sync_rows(0, "dense")
    assert {(r.gradients, r.group) for r in dense0} == {("shared", "data-parallel"), ("norm", "world")}
    demix2 = sync_rows(2, "demix")
    assert ("expert e", "e's domain", "grad_accum") in {(r.gradients, r.group, r.per_step) for r in demix2}
