"""Link rates in tc's units, and a token bucket that lets a shaped link carry its rate."""

import pytest

from netpart.testbed import netns


def test_rates_read_as_tc_reads_them():
    assert netns.rate_bps("1gbit") == 1e9
    assert netns.rate_bps("100Mbit") == 1e8
    assert netns.rate_bps("12.5mbps") == 1e8  # bytes per second
    for bad in ("fast", "1 gbit", "1gb", ""):
        with pytest.raises(ValueError, match="link rate"):
            netns.rate_bps(bad)


def test_a_bucket_holds_half_a_millisecond_of_the_rate_and_at_least_an_offload_packet():
    """A bucket smaller than a 64 KiB offload packet makes tbf release it frame by frame
    (docs/measurements.md, the emulated link's token bucket)."""
    assert netns.burst_for("10gbit") == "625000"
    assert netns.burst_for("1gbit") == "81920"
    assert netns.burst_for("100mbit") == "81920"


def test_a_testbed_refuses_a_rate_tc_cannot_read_before_making_anything():
    from netpart.testbed.bed import TestbedError, up

    with pytest.raises(TestbedError, match="--link: link rate 'fast'"):
        up("tbx", 2, cpu=0.3, rate="fast")
