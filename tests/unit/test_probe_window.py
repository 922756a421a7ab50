"""The probe's GEMV window spans the CFS quota period of the rank's cgroup
(`tandem.engine.device_probe.cpu_quota`, `probe_window_s`): cgroup v1 and v2 layouts read from a
directory tree laid out as /sys/fs/cgroup is."""

import pytest
import torch

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine import device_probe as dp
from tandem.engine.tp.probe import lockstep_gemv_gb_s


def _v1(root, rel, quota, period):
    d = root / "cpu" / rel
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (d / "cpu.cfs_period_us").write_text(f"{period}\n")


def test_v1_quota_of_the_process_group_is_read_with_its_period(tmp_path):
    _v1(tmp_path, "", -1, 100000)
    _v1(tmp_path, "slow", 50000, 100000)
    assert dp.cpu_quota("4:cpu,cpuacct:/slow\n1:memory:/x\n", tmp_path) == (0.5, 0.1)


def test_v1_tightest_quota_among_ancestors_wins(tmp_path):
    _v1(tmp_path, "", 150000, 100000)
    _v1(tmp_path, "a", 20000, 10000)  # 2 CPUs
    _v1(tmp_path, "a/b", -1, 100000)
    assert dp.cpu_quota("3:cpu:/a/b\n", tmp_path) == (1.5, 0.1)


def test_v2_cpu_max_is_read_and_max_means_no_quota(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "job" / "cpu.max").write_text("25000 50000\n")
    assert dp.cpu_quota("0::/job\n", tmp_path) == (0.5, 0.05)
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert dp.cpu_quota("0::/job\n", tmp_path) is None


def test_unreadable_cgroups_raise_and_the_window_falls_back_to_the_minimum(tmp_path, monkeypatch):
    with pytest.raises(OSError):
        dp.cpu_quota("1:cpu:/\n", tmp_path)
    monkeypatch.setattr(dp, "cpu_quota", lambda: (_ for _ in ()).throw(OSError("none")))
    assert dp.probe_window_s() == dp.MIN_WINDOW_S


def test_window_spans_several_quota_periods(monkeypatch):
    monkeypatch.setattr(dp, "cpu_quota", lambda: (0.5, 0.1))
    assert dp.probe_window_s() == pytest.approx(dp.QUOTA_PERIODS * 0.1)
    monkeypatch.setattr(dp, "cpu_quota", lambda: (0.5, 0.01))
    assert dp.probe_window_s() == dp.MIN_WINDOW_S
    monkeypatch.setattr(dp, "cpu_quota", lambda: None)
    assert dp.probe_window_s() == dp.PLAIN_WINDOW_S


def test_lockstep_gemv_on_one_rank_runs_at_least_the_minimum_steps():
    (rate,) = run_ranks(
        ReferenceCommunicator.group(1),
        lambda c: lockstep_gemv_gb_s(c, torch.device("cpu"), torch.float32, 0.0),
    )
    assert rate > 0
