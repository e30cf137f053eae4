"""The one byte formatter (service/domain/units.py) in the styles its callers use."""

from service.domain.units import human_bytes

GiB, MiB = 2**30, 2**20


def test_human_bytes_picks_the_unit_or_keeps_the_one_asked_for():
    assert human_bytes(None) == "-" and human_bytes(None, "?") == "?"
    assert human_bytes(1000) == "1000 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(47 * MiB) == "47.0 MiB" and human_bytes(3 * GiB) == "3.0 GiB"
    assert human_bytes(5 * 2**40) == "5.0 TiB" and human_bytes(2**60) == f"{2**20:.1f} TiB"
    # the pre-flight's messages (DoesNotFit detail): always GiB, two decimals
    assert human_bytes(GiB // 2, unit="GiB", digits=2) == "0.50 GiB"
    assert human_bytes(int(39.5 * GiB), unit="GiB", digits=2) == "39.50 GiB"
    # the planner's table below a GiB: MiB, one decimal
    assert human_bytes(512 * MiB, unit="MiB") == "512.0 MiB"
