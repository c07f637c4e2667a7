"""vkattn.measure's verdicts: cached on disk per device and shader build, reused by a new process,
run again when asked (check --remeasure) or when the build changes; errors are not cached. The
self-test cases themselves run on a device with cooperative matrices (tests/test_coopmat.py)."""
import json

import pytest

import vkattn
from vkattn import measure


@pytest.fixture
def disk(tmp_path, monkeypatch):
    monkeypatch.setenv("VKATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VKATTN_MEASURE_CACHE", raising=False)
    return tmp_path


class FakeDevice:
    key = "Fake GPU | fakedriver 1.0 42"


def test_a_verdict_is_measured_once_and_read_back(disk):
    runs = []
    m = measure._cached("probe_x", lambda dev: runs.append(1) or {"coopmat": 1.0, "other": "tile", "tile": 2.0})
    dev = FakeDevice()
    first = m(dev)
    assert m(dev) == first and len(runs) == 1                 # from the disk: not run again
    files = list(disk.glob("measures-*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    (entry,) = stored.values()
    assert entry["probe_x"] == first and entry["device"] == dev.key and "probe_x_when" in entry
    assert m(dev, fresh=True) == first and len(runs) == 2     # check --remeasure: run again


def test_another_device_or_build_measures_again(disk, monkeypatch):
    runs = []
    m = measure._cached("probe_y", lambda dev: runs.append(dev.key) or "")
    a, b = FakeDevice(), FakeDevice()
    b.key = "Other GPU | fakedriver 1.0 42"
    m(a), m(b), m(a)
    assert runs == [a.key, b.key]
    monkeypatch.setattr(measure, "CASES_VERSION", measure.CASES_VERSION + 1)   # the cases changed
    m(a)
    assert runs == [a.key, b.key, a.key]


def test_the_build_key_follows_the_shaders(disk, tmp_path, monkeypatch):
    before = measure._build_key()
    src = tmp_path / "shaders"
    src.mkdir()
    for p in vkattn.compiler.shader_dir().iterdir():
        if p.name.endswith((".comp", ".glsl")):
            (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(vkattn.compiler, "shader_dir", lambda: src)
    assert measure._build_key() == before
    (src / "attn_coopmat.comp").write_text((src / "attn_coopmat.comp").read_text() + "\n// edited\n")
    assert measure._build_key() != before


@pytest.mark.parametrize("switch,value", [("VKATTN_COOPMAT_TILE", "8,4"), ("VKATTN_COOPMAT_FIXED_TRIPS", "0"),
                                          ("VKATTN_COOPMAT_STAGE_BATCH", "0")])
def test_the_build_key_follows_the_coopmat_build_switches(disk, monkeypatch, switch, value):
    """A switch that builds attn_coopmat.comp's pipelines otherwise gives verdicts of their own
    (the key held only the sources: a forced run of another build read the default build's)."""
    before = measure._build_key()
    monkeypatch.setenv(switch, value)
    assert measure._build_key() != before
    monkeypatch.delenv(switch)
    assert measure._build_key() == before


def test_errors_are_not_cached_and_the_switch_turns_the_file_off(disk, monkeypatch):
    runs = []
    m = measure._cached("probe_z", lambda dev: runs.append(1) or {"error": "no timestamps"})
    m(FakeDevice()), m(FakeDevice())
    assert len(runs) == 2 and not list(disk.glob("measures-*.json"))
    monkeypatch.setenv("VKATTN_MEASURE_CACHE", "0")
    ok = measure._cached("probe_w", lambda dev: runs.append(1) or "")
    ok(FakeDevice()), ok(FakeDevice())
    assert len(runs) == 4 and not list(disk.glob("measures-*.json"))


def test_a_corrupt_file_is_measured_over(disk):
    dev = FakeDevice()
    measure._path(dev).write_text("{not json")
    runs = []
    m = measure._cached("probe_v", lambda d: runs.append(1) or "")
    assert m(dev) == "" and m(dev) == "" and runs == [1]


@pytest.mark.parametrize("name,bad,good", [
    ("coopmat_speed", {"coopmat": 1.0}, {"coopmat": 1.0, "other": "tile", "tile": 2.0}),   # KeyError: 'other'
    ("coopmat_speed", [1, 2], {"coopmat": 1.0, "other": "tile", "tile": 2.0}),
    ("coopmat_speed", None, {"coopmat": 1.0, "other": "tile", "tile": 2.0}),
    ("coopmat_speed", {"coopmat": "fast", "other": "tile", "tile": 2.0}, {"coopmat": 1.0, "other": "tile", "tile": 2.0}),
    ("coopmat_self_test", ["bad"], ""), ("coopmat_self_test", 0, "int8 chunk: off by 3"),
])
def test_a_stored_value_of_the_wrong_shape_is_measured_over(disk, name, bad, good):
    """An entry that parses but is not what the measure returns (a damaged file, another
    version's layout): measured again and stored anew, not returned (the planner indexed a
    speed entry without "other": KeyError)."""
    dev = FakeDevice()
    measure._path(dev).write_text(json.dumps({measure._build_key(): {name: bad, "device": dev.key}}))
    runs = []
    m = measure._cached(name, lambda d: runs.append(1) or good)
    assert m(dev) == good and m(dev) == good and runs == [1]

