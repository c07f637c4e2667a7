"""perf/q4_study.py's candidate 4-bit layouts (host numpy): its "q4 (vkattn)" is vkattn's q4, every
candidate rounds within half its step, and the Hadamard rotation is orthonormal."""
import numpy as np
import pytest

from perf import q4_study as S
from vkattn.reference import round_to


@pytest.mark.parametrize("d", [13, 32, 37, 64, 128])
def test_q4_is_vkattns_q4_and_sym32_the_first_q4(d):
    x = np.random.default_rng(d).standard_normal((3, 5, d)).astype(np.float32) * 4
    x[0, 0] = 0                                   # an all-zero row: values 0
    assert np.array_equal(S.candidates()["q4 (vkattn)"](x), round_to(x, "q4"))
    y = S.sym(x)                                  # the first q4: -7..7 times amax / 7
    blocks, _ = S._blocks(x, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    lv = S._blocks(y, 32)[0] / np.where(amax > 0, amax / 7, 1)
    assert np.allclose(lv, np.rint(lv), atol=1e-4) and np.abs(lv).max() <= 7 + 1e-4


@pytest.mark.parametrize("d", [29, 64])
def test_asym_and_sym16_stay_within_half_a_step(d):
    x = np.random.default_rng(1).standard_normal((2, 7, d)).astype(np.float32) + 3   # one-signed: asym's case
    for fn, b in ((S.asym, 32), (lambda v: S.sym(v, 16), 16), (S.zp, 32)):
        y = fn(x)
        assert y.shape == x.shape and np.isfinite(y).all()
        blocks, _ = S._blocks(x, b)
        step = {S.asym: (blocks.max(-1) - blocks.min(-1)) / 15,
                S.zp: (np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)) / 15}.get(fn, np.abs(blocks).max(-1) / 7)
        err = np.abs(S._blocks(y, b)[0] - blocks).max(-1)
        assert (err <= step * 0.5 * (1 + 2e-3) + 1e-6).all()
    # the asymmetric grid is finer than the symmetric one on one-signed data
    assert np.abs(S.asym(x) - x).mean() < np.abs(S.sym(x) - x).mean()


def test_hadamard_rotation_is_orthonormal_and_undone():
    h = S.hadamard(64)
    assert np.allclose(h @ h.T, np.eye(64), atol=1e-6)
    x = np.random.default_rng(2).standard_normal((2, 3, 128)).astype(np.float32)
    assert np.allclose(S.rotated(lambda v: v)(x), x, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 64"):
        S.rotated(lambda v: v)(x[..., :37])


def test_unknown_candidate_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("VKATTN_PERF_Q4_STUDY", "q4,nope")
    assert S.main([]) == 2
    assert "unknown candidate" in capsys.readouterr().err
