import pytest

from directkv.costmodel import CostModel, Efficiency, mode_for
from directkv.kernels.traffic import Traffic
from directkv.specs import get_hardware

H200 = get_hardware("h200-pcie5")


def test_roofline_takes_the_largest_term():
    cm = CostModel(H200, Efficiency(link_sm=1.0, hbm=1.0, attention=1.0))
    link = Traffic(link_read_bytes=int(51.4e9))  # one second over the SM read ceiling
    assert cm.time(link, link="sm") == pytest.approx(1.0 + H200.launch_us * 1e-6)
    assert cm.bound(link) == "link_read"
    both = Traffic(link_read_bytes=int(51.4e9), hbm_read_bytes=int(2 * 4100e9))
    assert cm.time(both) == pytest.approx(2.0, rel=1e-4) and cm.bound(both) == "hbm"
    # the copy engine is faster than SM loads on this PCIe host
    assert cm.time(link, link="ce") < cm.time(link, link="sm")


def test_efficiency_slows_down_and_copy_time():
    fast, slow = CostModel(H200, Efficiency(link_sm=1.0)), CostModel(H200, Efficiency(link_sm=0.5))
    t = Traffic(link_read_bytes=10**9)
    assert slow.time(t) - H200.launch_us * 1e-6 == pytest.approx(2 * (fast.time(t) - H200.launch_us * 1e-6))
    assert fast.copy_time(0) == 0.0
    assert fast.copy_time(55.4e9) == pytest.approx(1.0, rel=1e-4)


def test_mode_labels():
    assert mode_for(H200) == "simulated" and mode_for(get_hardware("gh200-c2c")) == "projected"
