"""The outer hub's numbers on the wire, and what ``SitesReport`` makes of the hub's rounds and weights.

``round_to_bf16`` (numpy, on the hub) must round exactly as torch rounds float32 to bfloat16 on the sites
(``diloco_sites.to_wire``), bit for bit: random values, ties (to nearest even), the edges of the range, infinities,
zeros, subnormals; NaN stays NaN. ``from_wire`` reads bf16 and fp32 payloads back. ``SitesReport`` is built from
made-up ``RoundRecord``s: bytes per full round, the model by parameter name, the refusal of a sharded model.
"""

import numpy
import pytest
import torch

from labkit.runs.outer_hub import RoundRecord, bf16_to_float, from_wire, round_to_bf16
from labkit.spec.errors import LabError
from labkit.views.sites_report import SitesReport, largest_relative_difference


def torch_bits(values: numpy.ndarray) -> numpy.ndarray:
    bits = torch.from_numpy(values.astype(numpy.float32)).to(torch.bfloat16).view(torch.int16)
    return bits.numpy().view(numpy.uint16)


def torch_rounded(values: numpy.ndarray) -> numpy.ndarray:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).float().numpy()


def from_bits(*bits: int) -> numpy.ndarray:
    return numpy.array(bits, dtype=numpy.uint32).view(numpy.float32)


def same_as_torch(values: numpy.ndarray) -> None:
    bits = round_to_bf16(values)
    assert bits.dtype == numpy.uint16 and bits.shape == values.shape
    numpy.testing.assert_array_equal(bits, torch_bits(values))
    numpy.testing.assert_array_equal(bf16_to_float(bits).view(numpy.uint32), torch_rounded(values).view(numpy.uint32))


# -- round_to_bf16 / bf16_to_float ---------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4, 1e30])
def test_random_values_round_to_the_bits_torch_gives(scale):
    values = (numpy.random.default_rng(7).standard_normal(100_000) * scale).astype(numpy.float32)
    same_as_torch(values)


def test_random_bit_patterns_round_to_the_bits_torch_gives():
    values = numpy.random.default_rng(8).integers(0, 2**32, 200_000, dtype=numpy.uint64).astype(numpy.uint32)
    values = values.view(numpy.float32)
    values = values[~numpy.isnan(values)]
    same_as_torch(values)


def test_a_tie_rounds_to_the_even_neighbour():
    # low 16 bits exactly 0x8000: halfway between two bfloat16; the even one (last bit 0) wins
    values = from_bits(0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x00018000, 0x7F7F8000)
    numpy.testing.assert_array_equal(round_to_bf16(values),
                                     numpy.array([0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x0000, 0x0002, 0x7F80]))
    same_as_torch(values)


def test_just_off_a_tie_rounds_to_the_nearer_neighbour():
    values = from_bits(0x3F807FFF, 0x3F808001, 0x3F817FFF, 0x3F818001)
    numpy.testing.assert_array_equal(round_to_bf16(values), numpy.array([0x3F80, 0x3F81, 0x3F81, 0x3F82]))
    same_as_torch(values)


def test_every_tie_near_one_rounds_as_torch_rounds():
    high = numpy.arange(0x3F00, 0x4100, dtype=numpy.uint32)
    same_as_torch(((high << 16) | 0x8000).view(numpy.float32))


def test_infinities_and_zeros_keep_their_bits():
    values = numpy.array([numpy.inf, -numpy.inf, 0.0, -0.0], dtype=numpy.float32)
    numpy.testing.assert_array_equal(round_to_bf16(values), numpy.array([0x7F80, 0xFF80, 0x0000, 0x8000]))
    same_as_torch(values)
    assert numpy.signbit(bf16_to_float(round_to_bf16(values))[3])


def test_the_largest_floats_round_to_infinity_as_in_torch():
    values = numpy.array([numpy.finfo(numpy.float32).max, -numpy.finfo(numpy.float32).max], dtype=numpy.float32)
    same_as_torch(values)
    assert numpy.isinf(bf16_to_float(round_to_bf16(values))).all()


def test_the_largest_bfloat16_stays_finite():
    values = from_bits(0x7F7F0000, 0x7F7F7FFF, 0xFF7F7FFF)
    numpy.testing.assert_array_equal(round_to_bf16(values), numpy.array([0x7F7F, 0x7F7F, 0xFF7F]))
    same_as_torch(values)


def test_subnormals_round_as_in_torch_and_are_not_flushed_to_zero():
    values = numpy.concatenate([from_bits(0x00000001, 0x00007FFF, 0x00008001, 0x0000FFFF, 0x007FFFFF, 0x80000001,
                                          0x8000C000, 0x807FFFFF),
                                numpy.array([1e-40, -1e-40, 1.1754942e-38], dtype=numpy.float32)])
    same_as_torch(values)
    assert round_to_bf16(from_bits(0x0000C000))[0] == 0x0001  # a subnormal bfloat16, not zero


def test_nan_stays_nan_whatever_its_bits():
    values = from_bits(0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF)
    back = bf16_to_float(round_to_bf16(values))
    assert numpy.isnan(back).all()
    assert numpy.isnan(torch_rounded(values)).all()  # torch agrees that they are NaN (its NaN bits may differ)


def test_nan_among_numbers_leaves_the_numbers_rounded_as_in_torch():
    values = numpy.array([1.5, numpy.nan, -2.75, numpy.nan, 3.14159], dtype=numpy.float32)
    bits = round_to_bf16(values)
    numbers = ~numpy.isnan(values)
    numpy.testing.assert_array_equal(bits[numbers], torch_bits(values[numbers]))
    assert numpy.isnan(bf16_to_float(bits)[~numbers]).all()


def test_float64_input_is_rounded_as_its_float32():
    values = numpy.random.default_rng(9).standard_normal(1000)
    numpy.testing.assert_array_equal(round_to_bf16(values), torch_bits(values.astype(numpy.float32)))


def test_the_input_is_left_unchanged():
    values = numpy.random.default_rng(10).standard_normal(100).astype(numpy.float32)
    before = values.copy()
    round_to_bf16(values)
    numpy.testing.assert_array_equal(values, before)


def test_a_bfloat16_value_survives_a_second_rounding_unchanged():
    bits = round_to_bf16(numpy.random.default_rng(11).standard_normal(10_000).astype(numpy.float32))
    numpy.testing.assert_array_equal(round_to_bf16(bf16_to_float(bits)), bits)


def test_bf16_to_float_puts_the_bits_in_the_high_half_of_a_float32():
    back = bf16_to_float(numpy.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80], dtype=numpy.uint16))
    assert back.dtype == numpy.float32
    numpy.testing.assert_array_equal(back.view(numpy.uint32),
                                     numpy.array([0x3F800000, 0xC0000000, 0, 0x80000000, 0x7F800000]))


def test_the_hubs_bits_are_the_bits_a_site_puts_on_the_wire():
    from labkit.strategies import diloco_sites

    values = (numpy.random.default_rng(12).standard_normal(5000) * 1e-2).astype(numpy.float32)
    assert round_to_bf16(values).tobytes() == diloco_sites.to_wire(torch.from_numpy(values), "bf16")


# -- from_wire -----------------------------------------------------------------------------


def test_fp32_on_the_wire_comes_back_exactly():
    values = numpy.concatenate([numpy.random.default_rng(13).standard_normal(1000).astype(numpy.float32),
                                from_bits(0x00000001, 0x80000000, 0x7F7FFFFF),
                                numpy.array([numpy.inf, -numpy.inf], dtype=numpy.float32)])
    back = from_wire(values.tobytes(), "fp32")
    assert back.dtype == numpy.float32
    numpy.testing.assert_array_equal(back.view(numpy.uint32), values.view(numpy.uint32))


def test_fp32_from_the_wire_is_a_writable_copy_the_hub_may_add_to():
    payload = numpy.ones(4, dtype=numpy.float32).tobytes()
    back = from_wire(payload, "fp32")
    back += 1  # a view of the (read-only) bytes would refuse this
    numpy.testing.assert_array_equal(back, numpy.full(4, 2, dtype=numpy.float32))


def test_bf16_on_the_wire_comes_back_as_the_rounded_float32():
    values = numpy.random.default_rng(14).standard_normal(1000).astype(numpy.float32)
    back = from_wire(round_to_bf16(values).tobytes(), "bf16")
    assert back.dtype == numpy.float32 and back.shape == values.shape
    numpy.testing.assert_array_equal(back, torch_rounded(values))


def test_bf16_from_a_site_reads_back_as_torch_reads_it():
    from labkit.strategies import diloco_sites

    values = numpy.random.default_rng(15).standard_normal(1000).astype(numpy.float32)
    payload = diloco_sites.to_wire(torch.from_numpy(values), "bf16")
    numpy.testing.assert_array_equal(from_wire(payload, "bf16"), diloco_sites.from_wire(payload, "bf16").numpy())


def test_an_empty_payload_is_an_empty_vector():
    assert from_wire(b"", "bf16").shape == (0,) and from_wire(b"", "fp32").shape == (0,)


# -- SitesReport ---------------------------------------------------------------------------


def record(number: int, used: list[str], left_out: list[str] = (), bytes_in: int = 0, bytes_out: int = 0):
    return RoundRecord(round=number, shares={name: (number, index) for index, name in enumerate(used)},
                       used=list(used), left_out=list(left_out), opened=float(number), seconds=1.0,
                       bytes_in=bytes_in, bytes_out=bytes_out)


def report(rounds=(), sites=("a", "b"), **fields) -> SitesReport:
    values = dict(sites=list(sites), replicas=len(sites), inner_steps=10, wire="bf16", rounds=list(rounds),
                  losses=[2.0, 1.5], model_bytes=4000, seconds=12.0)
    values.update(fields)
    return SitesReport(**values)


def test_hub_bytes_per_round_is_the_mean_over_full_rounds():
    rounds = [record(0, ["a", "b"], bytes_in=100, bytes_out=200), record(1, ["a", "b"], bytes_in=300, bytes_out=400)]
    assert report(rounds).hub_bytes_per_round == pytest.approx((300 + 700) / 2)


def test_a_round_with_a_site_left_out_does_not_count_in_hub_bytes_per_round():
    rounds = [record(0, ["a", "b"], bytes_in=100, bytes_out=100),
              record(1, ["a"], left_out=["b"], bytes_in=10_000, bytes_out=10_000),
              record(2, ["a", "b"], bytes_in=300, bytes_out=300)]
    assert report(rounds).hub_bytes_per_round == pytest.approx(400)


def test_hub_bytes_per_round_is_zero_without_a_full_round():
    assert report([record(0, ["a"], left_out=["b"], bytes_in=5, bytes_out=5)]).hub_bytes_per_round == 0.0
    assert report([]).hub_bytes_per_round == 0.0


def test_a_round_where_no_site_sent_is_not_a_full_round_even_without_sites():
    assert report([record(0, [], bytes_in=7, bytes_out=7)], sites=()).hub_bytes_per_round == 0.0


def test_model_state_reshapes_the_flat_weights_by_the_layout_in_order():
    flat = numpy.arange(6 + 3 + 1 + 4, dtype=numpy.float32)
    layout = [("layer.weight", (2, 3)), ("layer.bias", (3,)), ("scale", ()), ("head.weight", (1, 4))]
    state = report(weights={0: flat}, layouts={0: layout}).model_state()
    assert list(state) == ["layer.weight", "layer.bias", "scale", "head.weight"]
    numpy.testing.assert_array_equal(state["layer.weight"], [[0, 1, 2], [3, 4, 5]])
    numpy.testing.assert_array_equal(state["layer.bias"], [6, 7, 8])
    assert state["scale"].shape == () and state["scale"] == 9
    numpy.testing.assert_array_equal(state["head.weight"], [[10, 11, 12, 13]])
    assert all(array.dtype == numpy.float32 for array in state.values())


def test_model_state_gives_copies_that_do_not_change_the_reports_weights():
    flat = numpy.zeros(4, dtype=numpy.float32)
    sites = report(weights={0: flat}, layouts={0: [("w", (2, 2))]})
    state = sites.model_state()
    state["w"][0, 0] = 5.0
    assert flat[0] == 0.0 and sites.model_state()["w"][0, 0] == 0.0


def test_model_state_turns_into_torch_tensors_a_model_loads():
    model = torch.nn.Linear(3, 2)
    layout = [(name, tuple(parameter.shape)) for name, parameter in model.state_dict().items()]
    flat = numpy.arange(8, dtype=numpy.float32)
    state = report(weights={0: flat}, layouts={0: layout}).model_state()
    model.load_state_dict({name: torch.from_numpy(array) for name, array in state.items()})
    assert torch.equal(model.weight, torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_model_state_refuses_weights_sharded_over_several_holders():
    sites = report(weights={0: numpy.zeros(2, numpy.float32), 1: numpy.zeros(2, numpy.float32)},
                   layouts={0: [("a", (2,))], 1: [("b", (2,))]})
    with pytest.raises(LabError, match=r"sharded the model.*lab\.site\(name\)\.model_state\(\)"):
        sites.model_state()


def test_model_state_refuses_a_report_without_weights():
    with pytest.raises(LabError):
        report().model_state()


@pytest.mark.parametrize("wire, size", [("bf16", 2), ("fp32", 4)])
def test_wire_bytes_per_number_follows_the_wire(wire, size):
    assert report(wire=wire).wire_bytes_per_number == size


@pytest.mark.parametrize("difference, noise, equivalent", [
    (None, 0.0, None), (0.0, 0.0, True), (9.9e-6, 0.0, True), (1e-5, 0.0, False),  # the 1e-5 floor
    (3e-5, 4e-6, True), (4e-5, 4e-6, False),  # 10 x the rounding noise above the floor
    (9e-4, 1.0, True), (1e-3, 1.0, False)])  # never above 1e-3, however noisy the run
def test_equivalent_is_the_difference_within_the_labs_bound_on_the_runs_rounding_noise(difference, noise, equivalent):
    made = report(verify_difference=difference, verify_noise=noise)
    assert made.equivalent is equivalent
    if difference is not None:
        assert ("NOT equal" in str(made)) is (not equivalent) and f"rounding noise {noise:.1e}" in str(made)


def test_the_relative_difference_is_each_parameters_own_and_the_largest_is_reported():
    layout = [("big", [2]), ("small", [2, 1]), ("scalar", [])]
    expected = numpy.array([100.0, 0.0, 3.0, 4.0, 1.0], dtype=numpy.float32)
    got = expected.copy()
    assert largest_relative_difference(got, expected, layout) == 0.0
    got[0] += 1.0  # 1 against a norm of 100
    assert largest_relative_difference(got, expected, layout) == pytest.approx(0.01)
    got[3] += 0.5  # 0.5 against a norm of 5: the small parameter's error is not hidden by the big one
    assert largest_relative_difference(got, expected, layout) == pytest.approx(0.1)
    got[4] = -1.0  # the scalar flipped: 2 against 1
    assert largest_relative_difference(got, expected, layout) == pytest.approx(2.0)


def test_the_final_loss_is_the_last_global_steps_or_none():
    assert report(losses=[3.0, 2.0, 1.25]).final_loss == 1.25
    assert report(losses=[]).final_loss is None


def test_the_summary_names_the_rounds_with_sites_left_out():
    text = str(report([record(0, ["a", "b"]), record(1, ["a"], left_out=["b"])]))
    assert "DiLoCo across 2 sites (a, b): 2 rounds" in text
    assert "round 1: b" in text and "round 0:" not in text
