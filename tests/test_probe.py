"""The disk read probe that seeds codec choices before any record was read back."""
import pytest

from tierkv.pipeline.controller import CompressionController
from tierkv.storage import probe


def test_read_bandwidth_measures_once_per_filesystem_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "_measured", {})
    calls = []
    real = probe._probe
    monkeypatch.setattr(probe, "_probe", lambda d, n: calls.append(d) or real(d, n))
    first = probe.read_bandwidth(tmp_path, 1 << 20)
    (tmp_path / "sub").mkdir()
    assert probe.read_bandwidth(tmp_path / "sub", 1 << 20) == first > 0
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["sub"]  # no scratch file left behind


def test_read_bandwidth_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        probe.read_bandwidth(tmp_path / "absent")
    with pytest.raises(ValueError, match="nbytes"):
        probe.read_bandwidth(tmp_path, 1000)


def test_assumed_disk_speed_lets_the_controller_choose_until_reads_are_measured():
    controller = CompressionController(("raw", "zstd"), decode_bw={"raw": 20e9, "zstd": 0.5e9},
                                       ratio={"raw": 1.0, "zstd": 0.92})
    assert controller.state()["disk_bw"] is None
    controller.assume_disk(2e9)
    assert controller.state()["disk_bw"] == 2e9
    assert controller.choose(1 << 20) == "raw"  # fp32 KV barely compresses: decode would cost more
    controller.observe_read(1 << 20, 1.0)  # a real read moves the estimate as usual...
    measured = controller.state()["disk_bw"]
    assert measured < 2e9
    controller.assume_disk(5e9)  # ...and a later assumption no longer overrides it
    assert controller.state()["disk_bw"] == measured
    with pytest.raises(ValueError, match="disk_bw"):
        controller.assume_disk(0)
