"""hethub's profile file: round trip, merging, loading directories, and errors that name the field."""

import json
from dataclasses import replace

import pytest

from conftest import tiny_model
from hethub.emulation.effects import HostEffects
from hethub.emulation.stragglers import SpeedSpread
from hethub.errors import SpecError
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry, ProfileSet
from hethub.profile import (
    load_host_effects,
    load_profiles,
    merge_profiles,
    profile_to_dict,
    read_profile,
    read_profile_file,
    scan_profiles,
    write_profile,
)


def _profile(kind: str = "fast", *, model: str = "t", seq_len: int = 32, scale: float = 1.0,
             entries: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 2))) -> KindProfile:
    def times(base: float) -> LayerTimes:
        return LayerTimes(base * scale, 2 * base * scale, base / 10)

    return KindProfile(kind=kind, model=model, seq_len=seq_len, entries={
        (m, t): ProfileEntry(times(1e-4 * m / t), times(1e-3 * m / t), times(5e-4 * m / t),
                             peak_mem_bytes=1_000_000 * m if t == 1 else None)
        for m, t in entries})


def test_round_trip_is_exact(tmp_path):
    prof = _profile()
    path = tmp_path / "fast.json"
    write_profile(path, prof, model=tiny_model(), device="cpu: test", measured_at="2026-01-01T00:00:00+00:00")
    again = read_profile(path)
    assert again.entries == prof.entries
    assert (again.kind, again.model, again.seq_len) == ("fast", "t", 32)
    pf = read_profile_file(path)
    assert pf.model_shape == tiny_model()
    assert pf.device == "cpu: test"
    data = json.loads(path.read_text())
    assert data["format"] == "hethub-profile" and data["version"] == 1
    assert data["entries"][0]["peak_mem_bytes"] == 1_000_000
    assert {"fwd_s", "bwd_s", "update_s"} == set(data["entries"][0]["layer"])


def test_write_refuses_other_model():
    with pytest.raises(SpecError, match="'t'"):
        profile_to_dict(_profile(model="t"), model=tiny_model().__class__(**{**tiny_model().to_dict(), "name": "u"}),
                        device="x")


def test_load_dir_merges_two_kinds(tmp_path):
    m = tiny_model()
    write_profile(tmp_path / "fast.json", _profile("fast"), model=m, device="a")
    write_profile(tmp_path / "slow.json", _profile("slow", scale=3.0), model=m, device="b")
    ps = load_profiles(tmp_path, model=m, seq_len=32)
    assert set(ps.by_kind) == {"fast", "slow"}
    assert ps.get("slow").entries[(1, 1)].layer.fwd_s == pytest.approx(3 * ps.get("fast").entries[(1, 1)].layer.fwd_s)


def test_merge_same_kind_unites_entries_later_wins():
    a = _profile(entries=((1, 1), (2, 1)))
    b = _profile(entries=((2, 1), (4, 1)), scale=2.0)
    merged = merge_profiles([a, ProfileSet({"fast": b})]).get("fast")
    assert set(merged.entries) == {(1, 1), (2, 1), (4, 1)}
    assert merged.entries[(2, 1)] == b.entries[(2, 1)]
    with pytest.raises(SpecError, match="seq_len"):
        merge_profiles([a, _profile(seq_len=64)])


def test_mismatching_model_or_seq_len(tmp_path):
    m = tiny_model()
    other = tiny_model(layers=8)
    path = tmp_path / "fast.json"
    write_profile(path, _profile(), model=m, device="a")
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    with pytest.raises(SpecError, match="num_layers"):  # a file named explicitly: an error
        load_profiles(path, model=other)
    with pytest.raises(SpecError, match="seq_len 32"):
        load_profiles([path], seq_len=64)
    res = scan_profiles(tmp_path, model=other)  # found in a directory: skipped and reported
    assert res.profiles.by_kind == {}
    assert len(res.skipped) == 2
    assert any("num_layers" in s for s in res.skipped) and any("notes.json" in s for s in res.skipped)
    with pytest.warns(UserWarning, match="profile skipped"):
        load_profiles(tmp_path, model=other)


def _write(tmp_path, mutate) -> str:
    data = profile_to_dict(_profile(), model=tiny_model(), device="a")
    mutate(data)
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data))
    return str(p)


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d.pop("entries"), "'entries'"),
    (lambda d: d["entries"][1]["layer"].pop("fwd_s"), "'entries[1].layer.fwd_s'"),
    (lambda d: d["entries"][0]["head"].update(bwd_s="fast"), "'entries[0].head.bwd_s'"),
    (lambda d: d["entries"][0]["embedding"].update(update_s=-1), "'entries[0].embedding.update_s'"),
    (lambda d: d["entries"][0].update(mbs=0), "'entries[0].mbs'"),
    (lambda d: d["entries"][1].update(tp=1, mbs=2), "'entries[2]' repeats"),
    (lambda d: d["entries"][0].update(peak_mem_bytes=1.5), "'entries[0].peak_mem_bytes'"),
    (lambda d: d.update(seq_len="long"), "'seq_len'"),
    (lambda d: d.update(kind=""), "'kind'"),
    (lambda d: d["model_shape"].update(hidden_size=-4), "hidden_size"),
    (lambda d: d.update(model="other"), "'model_shape.name'"),
    (lambda d: d.update(format="sailor"), "'format'"),
    (lambda d: d.update(wake_penalty=[{"gap_s": 0.02, "extra_s": 1e-3}, {"gap_s": 0.01, "extra_s": 2e-3}]),
     "'wake_penalty[1]'"),
    (lambda d: d.update(wake_penalty=[{"gap_s": 0.02, "extra_s": -1}]), "'wake_penalty[0]'"),
    (lambda d: d["entries"][2].update(cpu_fraction=1.5), "'entries[2].cpu_fraction'"),
    (lambda d: d.update(speed_spread={"sigma": 0.1, "window_s": 0.1}), "'speed_spread'"),
    (lambda d: d.update(speed_spread=[{"sigma": 0.1}]), "'speed_spread[0]'"),
    (lambda d: d.update(speed_spread=[{"sigma": -0.1, "window_s": 0.1}]), "'speed_spread[0]'"),
    (lambda d: d.update(speed_spread=[{"sigma": 0.1, "window_s": 0.2}, {"sigma": 0.1, "window_s": 0.1}]),
     "'speed_spread[1]'"),
    (lambda d: d.update(split_backward={"b": 0.0, "w": 0.4}), "'split_backward'"),
    (lambda d: d.update(split_backward=[0.7, 0.4]), "'split_backward'"),
])
def test_malformed_file_names_the_field(tmp_path, mutate, field):
    path = _write(tmp_path, mutate)
    with pytest.raises(SpecError, match="Fix:") as err:
        read_profile(path)
    assert field in str(err.value)
    assert "p.json" in str(err.value)


def test_version_mismatch(tmp_path):
    path = _write(tmp_path, lambda d: d.update(version=2))
    with pytest.raises(SpecError, match=r"'version' is 2; this hethub reads version 1"):
        read_profile(path)


def test_not_json_or_missing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(SpecError, match="not valid JSON"):
        read_profile(bad)
    with pytest.raises(SpecError, match="does not exist"):
        read_profile(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(SpecError, match="not a profile"):
        read_profile(tmp_path / "x.json")


def test_layer_depths_round_trip_and_are_optional(tmp_path):
    prof = _profile(entries=((1, 1),))
    e = prof.entries[(1, 1)]
    deep = ((2, LayerTimes(0.9e-3, 1.8e-3, 1e-4)), (8, LayerTimes(1.5e-3, 3e-3, 0.8e-4)))
    prof = KindProfile(kind="fast", model="t", seq_len=32, entries={(1, 1): ProfileEntry(
        e.embedding, e.layer, e.head, peak_mem_bytes=e.peak_mem_bytes, layer_by_depth=deep)})
    path = tmp_path / "deep.json"
    write_profile(path, prof, model=tiny_model(), device="x")
    data = json.loads(path.read_text())
    assert [d["layers"] for d in data["entries"][0]["layer_depths"]] == [2, 8]
    assert read_profile(path).entries == prof.entries
    # A file without the field (older files) reads as depth-independent.
    del data["entries"][0]["layer_depths"]
    path.write_text(json.dumps(data))
    assert read_profile(path).entries[(1, 1)].layer_by_depth == ()
    data["entries"][0]["layer_depths"] = [{"layers": 1, "fwd_s": 1.0, "bwd_s": 1.0, "update_s": 0.0}]
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"entries\[0\]\.layer_depths\[0\]\.layers"):
        read_profile(path)


def test_wake_penalty_round_trips_interpolates_and_is_optional(tmp_path):
    host = HostEffects(wake_penalty=((0.01, 1e-3), (0.05, 3e-3)))
    path = tmp_path / "fast.json"
    write_profile(path, _profile(), model=tiny_model(), device="cpu: test", host=host)
    assert read_profile_file(path).host == host
    assert read_profile(path).entries == _profile().entries  # the kind's profile is the same either way
    assert host.wake_extra_s(0.0) == 0.0
    assert host.wake_extra_s(0.005) == pytest.approx(0.5e-3)
    assert host.wake_extra_s(0.03) == pytest.approx(2e-3)
    assert host.wake_extra_s(1.0) == pytest.approx(3e-3)  # flat beyond the longest measured gap
    later = tmp_path / "later.json"
    write_profile(later, _profile(entries=((4, 1),)), model=tiny_model(), device="cpu: test")
    assert "wake_penalty" not in json.loads(later.read_text()) and read_profile_file(later).host is None
    # Loading both keeps the measured penalty for the kind although the later file has none.
    assert load_host_effects([path, later]) == {"fast": host}


def test_speed_spread_round_trips_and_is_optional(tmp_path):
    host = HostEffects(speed_spread=(SpeedSpread(sigma=0.1, window_s=0.1), SpeedSpread(0.08, 0.4)))
    path = tmp_path / "fast.json"
    write_profile(path, _profile(), model=tiny_model(), device="cpu: test", host=host)
    assert read_profile_file(path).host == host
    woken = tmp_path / "woken.json"
    write_profile(woken, _profile(entries=((4, 1),)), model=tiny_model(), device="cpu: test",
                  host=HostEffects(wake_penalty=((0.01, 1e-3),)))
    assert "speed_spread" not in json.loads(woken.read_text())
    # Field by field: the later file's wake penalty joins the earlier file's spread.
    assert load_host_effects([path, woken]) == {"fast": replace(host, wake_penalty=((0.01, 1e-3),))}


def test_cpu_fraction_round_trips_and_defaults_to_one(tmp_path):
    base = _profile()
    prof = replace(base, entries={**base.entries, (1, 2): replace(base.entries[(1, 2)], cpu_fraction=0.6)})
    path = tmp_path / "fast.json"
    write_profile(path, prof, model=tiny_model(), device="cpu: test")
    again = read_profile(path)
    assert again.entries[(1, 2)].cpu_fraction == 0.6 and again.entries[(1, 1)].cpu_fraction == 1.0
    assert "cpu_fraction" not in json.loads(path.read_text())["entries"][0]


def test_split_backward_round_trips_and_is_optional(tmp_path):
    host = HostEffects(split_backward=(0.78, 0.31))
    path = tmp_path / "fast.json"
    write_profile(path, _profile(), model=tiny_model(), device="cpu: test", host=host)
    assert json.loads(path.read_text())["split_backward"] == {"b": 0.78, "w": 0.31}
    assert read_profile_file(path).host == host
    woken = tmp_path / "woken.json"
    write_profile(woken, _profile(entries=((4, 1),)), model=tiny_model(), device="cpu: test",
                  host=HostEffects(wake_penalty=((0.01, 1e-3),)))
    assert "split_backward" not in json.loads(woken.read_text())
    assert load_host_effects([path, woken]) == {"fast": replace(host, wake_penalty=((0.01, 1e-3),))}
