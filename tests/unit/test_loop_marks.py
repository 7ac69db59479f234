"""labkit.log and labkit.step outside a watched lab rank: nothing happens, and a bad count is refused alike."""

import pytest

import labkit


def test_outside_a_watched_rank_they_do_nothing():
    labkit.log(loss=1.5, accuracy=0.5)
    with labkit.step(samples=8, tokens=64):
        ran = True
    assert ran


@pytest.mark.parametrize("given", [dict(samples=-1), dict(samples=2.5), dict(tokens=True), dict(samples="8")])
def test_a_count_that_is_not_a_whole_number_is_refused_with_an_example(given):
    with pytest.raises(ValueError, match=r"whole number, 0 or more, e.g. labkit.step\("):
        with labkit.step(**given):
            pass
