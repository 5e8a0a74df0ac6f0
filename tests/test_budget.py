import pytest

from kvpop import Budget


def test_total_and_str():
    b = Budget(sink=4, window=128, topk=384)
    assert b.total == 516
    assert str(b) == "s4-w128-k384"


def test_minimal_budget():
    b = Budget(0, 1, 0)
    assert b.total == 1


def test_frozen_and_hashable():
    b = Budget(4, 16, 8)
    with pytest.raises(AttributeError):
        b.sink = 5  # type: ignore[misc]
    assert {b: 1}[Budget(4, 16, 8)] == 1


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(sink=True, window=4, topk=2), "sink"),
        (dict(sink=4, window=True, topk=2), "window"),
        (dict(sink=4, window=4, topk=False), "topk"),
        (dict(sink=4.0, window=4, topk=2), "sink"),
        (dict(sink=4, window=4.0, topk=2), "window"),
        (dict(sink=4, window=4, topk=2.0), "topk"),
        (dict(sink="4", window=4, topk=2), "sink"),
        (dict(sink=None, window=4, topk=2), "sink"),
        (dict(sink=-1, window=4, topk=2), "sink"),
        (dict(sink=4, window=-1, topk=2), "window"),
        (dict(sink=4, window=4, topk=-1), "topk"),
        (dict(sink=4, window=0, topk=2), "window"),
    ],
)
def test_invalid_field_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"Budget\.{field}\b"):
        Budget(**kwargs)


def test_from_total():
    b = Budget.from_total(1024, sink=4, window=128)
    assert b == Budget(4, 128, 892)
    assert b.total == 1024
    assert Budget.from_total(132, sink=4, window=128) == Budget(4, 128, 0)


def test_from_total_too_small():
    with pytest.raises(ValueError, match="smaller than sink \\+ window"):
        Budget.from_total(100, sink=4, window=128)


def test_from_total_validates_fields():
    with pytest.raises(ValueError, match=r"Budget\.window"):
        Budget.from_total(10, sink=4, window=0)


def test_compression_ratio():
    b = Budget.from_total(1024, sink=4, window=128)
    assert b.compression_ratio(4096) == pytest.approx(0.75)
    assert Budget.from_total(512, sink=4, window=128).compression_ratio(4096) == pytest.approx(0.875)
    assert b.compression_ratio(1024) == pytest.approx(0.0)


def test_parse_is_the_inverse_of_str():
    for b in (Budget(4, 256, 252), Budget(0, 1, 0), Budget(16, 1024, 3072)):
        assert Budget.parse(str(b)) == b
    for bad in ("w256", "s4-w256", "s4-w256-k252 ", "s-1-w2-k3", "s4-w0-k2"):
        with pytest.raises(ValueError):
            Budget.parse(bad)
