"""The perf scripts' environment parsing: defaults, comma lists, and a clear error on a bad value."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from perf.common import PerfConfigError, Shape, env_int_list  # noqa: E402


def test_defaults_and_lists(monkeypatch):
    for k in list(os.environ):
        if k.startswith("VKATTN_PERF_"):
            monkeypatch.delenv(k)
    shape = Shape.from_env()
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim, shape.dtype) == (32, 8, 128, 128, "float16")
    monkeypatch.setenv("VKATTN_PERF_CONTEXT", "512,4096,33")
    assert env_int_list("VKATTN_PERF_CONTEXT", [1]) == [512, 4096, 33]


@pytest.mark.parametrize("name,value,msg", [
    ("VKATTN_PERF_HEADS", "x", "expected an integer"),
    ("VKATTN_PERF_HEAD_DIM", "0", "expected an integer >= 1"),
    ("VKATTN_PERF_KV_HEADS", "3", "must be a multiple"),
    ("VKATTN_PERF_DTYPE", "bf16", "expected one of float16, float32"),
    ("VKATTN_PERF_ITERS", "-2", "expected an integer"),
])
def test_bad_values_are_errors(monkeypatch, name, value, msg):
    monkeypatch.setenv(name, value)
    with pytest.raises(PerfConfigError, match=msg):
        Shape.from_env()


def test_bad_context_list(monkeypatch):
    monkeypatch.setenv("VKATTN_PERF_CONTEXT", "512,,x")
    with pytest.raises(PerfConfigError, match="comma list"):
        env_int_list("VKATTN_PERF_CONTEXT", [1])
