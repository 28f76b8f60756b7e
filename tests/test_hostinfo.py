"""The /proc/cpuinfo reader behind result rows' CPU name and the native op's build key."""

from directkv import hostinfo

LINES = ["processor\t: 0", "model name\t: Example CPU @ 2.0GHz", "flags\t\t: fpu sse avx2", "processor\t: 1",
         "model name\t: Other CPU"]


def test_fields_come_from_the_first_cpu(monkeypatch):
    monkeypatch.setattr(hostinfo, "_cpuinfo", lambda: LINES)
    assert hostinfo.cpuinfo_field("model name") == "Example CPU @ 2.0GHz"
    assert hostinfo.cpuinfo_field("flags") == "fpu sse avx2"
    assert hostinfo.cpuinfo_field("microcode") is None
    assert hostinfo.cpu_name() == "Example CPU @ 2.0GHz"


def test_without_cpuinfo_the_name_comes_from_platform(monkeypatch):
    monkeypatch.setattr(hostinfo, "_cpuinfo", lambda: None)
    monkeypatch.setattr(hostinfo.platform, "processor", lambda: "")
    monkeypatch.setattr(hostinfo.platform, "machine", lambda: "x86_64")
    assert hostinfo.cpuinfo_field("flags") is None
    assert hostinfo.cpu_name() == "x86_64"
