"""Mesh specs: validation and geometry, no processes."""

import itertools

import pytest

from labkit.spec.mesh import MeshError, MeshSpec


def test_parse_names_and_sizes():
    spec = MeshSpec.parse("dp=2 tp=2", 4)
    assert spec.names == ("dp", "tp") and spec.shape == (2, 2)
    assert MeshSpec.parse("pp=2, dp=1,tp=2", 4).shape == (2, 1, 2)


def test_one_axis_may_be_inferred():
    assert MeshSpec.parse("dp=-1 tp=2", 8).shape == (4, 2)
    assert MeshSpec.from_axes({"dp": -1}, 3).shape == (3,)


@pytest.mark.parametrize(
    "text, world, message",
    [
        ("dp=3", 4, "holds 3 ranks but the lab has 4"),
        ("dp=2 tp=3", 4, "must multiply to 4"),
        ("dp=0 tp=4", 4, "positive integer"),
        ("dp=-2 tp=2", 4, "positive integer"),
        ("dp=-1 tp=-1", 4, "only one axis may be -1"),
        ("dp=-1 tp=3", 4, "does not divide the world size 4"),
        ("dp=2 dp=2", 4, "appears twice"),
        ("dp:2", 4, "name=size"),
        ("2=dp", 4, "name=size"),
        ("", 4, "name=size"),
    ],
)
def test_bad_specs_are_refused_with_a_reason(text, world, message):
    with pytest.raises(MeshError, match=message):
        MeshSpec.parse(text, world)


@pytest.mark.parametrize("axes", [{"dp": 2.0}, {"dp": True, "tp": 4}, {"dp": "2"}])
def test_sizes_must_be_integers(axes):
    with pytest.raises(MeshError, match="integer"):
        MeshSpec.from_axes(axes, 2)


def test_axis_names_must_be_identifiers():
    with pytest.raises(MeshError, match="not a valid name"):
        MeshSpec.from_axes([("data parallel", 2)], 2)
    with pytest.raises(MeshError, match="at least one named axis"):
        MeshSpec.from_axes({}, 2)


@pytest.mark.parametrize("shape", [(4,), (2, 2), (2, 1, 2), (2, 3), (2, 2, 2)])
def test_coordinates_are_row_major_like_device_mesh(shape):
    # init_device_mesh lays ranks out as arange(world).view(shape): last axis fastest.
    names = tuple(f"a{i}" for i in range(len(shape)))
    spec = MeshSpec(names, shape)
    expected = list(itertools.product(*(range(size) for size in shape)))
    assert [spec.coordinate(rank) for rank in range(spec.world_size)] == expected
    assert all(spec.rank_at(spec.coordinate(rank)) == rank for rank in range(spec.world_size))


def test_groups_along_each_axis():
    spec = MeshSpec.parse("dp=2 tp=2", 4)
    assert spec.groups("tp") == [[0, 1], [2, 3]]
    assert spec.groups("dp") == [[0, 2], [1, 3]]
    three = MeshSpec.parse("pp=2 dp=2 tp=2", 8)
    assert three.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(MeshError, match="no axis 'ep'"):
        spec.groups("ep")


def test_picture_shows_grid_and_groups():
    text = str(MeshSpec.parse("dp=2 tp=2", 4))
    assert "dp=1  rank 2  rank 3" in text
    assert "groups along tp: [0, 1] [2, 3]" in text
    html = MeshSpec.parse("pp=2 dp=1 tp=2", 4)._repr_html_()
    assert html.count("<table") == 2 and "pp=1" in html and "rank 3" in html
