"""Record schema, summary statistics and atomic writes."""

import math

import pandas as pd
import pyarrow.parquet as pq
import pytest

from kvroute.records import REQUEST_COLUMNS, imbalance, requests_table, summarize, write_csv, write_requests


def _row(**kw):
    base = dict(source="sim", experiment="e", hardware="h", policy="p", round=0, conversation="c0", turn=0,
                worker="w0", arrival_s=0.0, first_token_s=0.1, finish_s=1.0, ttft_ms=100.0, e2e_ms=1000.0,
                prompt_tokens=1000, cached_tokens=500, output_tokens=10, status="ok")
    base.update(kw)
    return base


def test_imbalance_is_cv():
    assert imbalance([5, 5, 5, 5]) == 0
    assert imbalance([4, 0, 0, 0]) == pytest.approx(math.sqrt(3))
    assert imbalance([]) == 0


def test_summary_counts_idle_workers_and_errors():
    rows = [_row(), _row(turn=1, cached_tokens=900, ttft_ms=50.0), _row(turn=2, status="error:connect")]
    df = pd.DataFrame(rows)
    s = summarize(df, {("e", "h", "p", 0): ["w0", "w1"]}).iloc[0]
    assert s.requests == 3 and s.errors == 1
    assert s.hit_rate == pytest.approx(1400 / 2000)
    assert s.later_ttft_mean_ms == pytest.approx(50.0)
    assert s.imbalance == pytest.approx(1.0)  # all work on one of two workers


def test_requests_table_has_contract_columns_in_order(tmp_path):
    t = requests_table([_row()])
    assert t.column_names == list(REQUEST_COLUMNS)
    write_requests(t, tmp_path / "r.parquet")
    assert pq.read_table(tmp_path / "r.parquet").num_rows == 1


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    class Boom(Exception):
        pass

    class Bad(pd.DataFrame):
        def to_csv(self, *a, **k):
            raise Boom

    with pytest.raises(Boom):
        write_csv(Bad({"a": [1]}), tmp_path / "s.csv")
    assert list(tmp_path.iterdir()) == []
