"""The core's layer-range functions against the pure-Python reference and the spec's examples.

Tensor ``t`` belongs to layer ``t // N`` (N = tensor_num_per_layer, default 2). Python ranges are
half-open with step 1 (None = all layers); C++ pairs are inclusive, ``(-1, -1)`` = all layers.
Every invalid input must raise LLMException(LLM_PARAM_INVALID) naming the bad value in the core
and ValueError in the reference.
"""

from __future__ import annotations


import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llm_datadist import _core
from llm_datadist import _reference as ref
from llm_datadist.status import LLMException, LLMStatusCode
from refusals import assert_both_refuse, names

PROPERTY = settings(max_examples=1000, deadline=None)



def weighted(*choices):
    """Draw from the strategies of ``(weight, strategy)`` choices in proportion to the weights."""
    return st.sampled_from([s for w, s in choices for _ in range(w)]).flatmap(lambda s: s)


NUM_TENSORS = weighted((3, st.sampled_from([2, 4, 6, 8, 12])), (1, st.integers(0, 12)))
TENSOR_NUM_PER_LAYER = weighted(
    (4, st.just(2)), (3, st.sampled_from([1, 2, 3, 4, 6])), (1, st.integers(-1, 14)),
    (1, st.sampled_from([True, False, 2.0, "2", None])))
PY_RANGES = weighted(
    (2, st.none()),
    (5, st.builds(range, st.integers(0, 4), st.integers(1, 6))),
    (2, st.builds(range, st.integers(-3, 8), st.integers(-3, 10), st.sampled_from([1, 2, -1]))),
    (1, st.sampled_from([(0, 1), [0, 1], 1, "x"])),
)
CPP_PAIRS = weighted(
    (2, st.just((-1, -1))),
    (5, st.tuples(st.integers(0, 4), st.integers(0, 6))),
    (2, st.tuples(st.integers(-3, 8), st.integers(-3, 8))),
    (1, st.sampled_from([None, (1,), (1, 2, 3), [0, 1], "ab", 5, (None, 1), (0, "x")])),
)

def same_outcome(core_call, ref_call):
    """Both return the same list(s), or both refuse: ValueError / LLMException(LLM_PARAM_INVALID)."""
    try:
        expected = ref_call()
    except ref.InvalidInput as refusal:
        with pytest.raises(LLMException) as info:
            core_call()
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert names(info.value.args[0], refusal.value), (info.value.args[0], refusal.value)
        event("refused")
        return None
    assert core_call() == expected
    event("valid")
    return expected


def assert_whole_layers(indices, num_tensors, n):
    """A valid result is the run of tensors ``[a*N, b*N)`` inside the cache."""
    assert indices, "a valid layer range selects at least one tensor"
    assert indices == list(range(indices[0], indices[-1] + 1))
    assert indices[0] % n == 0 and (indices[-1] + 1) % n == 0
    assert indices[-1] < num_tensors


# ------------------------------------------------------------------------------------------------
# Properties
# ------------------------------------------------------------------------------------------------

@PROPERTY
@given(PY_RANGES, NUM_TENSORS, TENSOR_NUM_PER_LAYER)
def test_python_range_matches_reference(layer_range, num_tensors, n):
    result = same_outcome(lambda: _core.layer_range_to_tensor_indices(layer_range, num_tensors, n),
                          lambda: ref.layer_range_to_tensor_indices(layer_range, num_tensors, n))
    if result is not None:
        assert_whole_layers(result, num_tensors, n)
        if layer_range is not None:
            assert result == list(range(layer_range.start * n, layer_range.stop * n))


@PROPERTY
@given(CPP_PAIRS, NUM_TENSORS, TENSOR_NUM_PER_LAYER)
def test_cpp_pair_matches_reference(pair, num_tensors, n):
    result = same_outcome(
        lambda: _core.inclusive_layer_range_to_tensor_indices(pair, num_tensors, n),
        lambda: ref.inclusive_layer_range_to_tensor_indices(pair, num_tensors, n))
    if result is not None:
        assert_whole_layers(result, num_tensors, n)


@PROPERTY
@given(st.integers(-3, 8), st.integers(-3, 9), NUM_TENSORS, st.integers(1, 6))
def test_python_range_equals_cpp_pair(start, stop, num_tensors, n):
    """``range(a, b)`` selects what ``(a, b - 1)`` selects; None what ``(-1, -1)`` selects."""
    def python(layer_range):
        try:
            return _core.layer_range_to_tensor_indices(layer_range, num_tensors, n)
        except LLMException:
            return "refused"

    def cpp(pair):
        try:
            return _core.inclusive_layer_range_to_tensor_indices(pair, num_tensors, n)
        except LLMException:
            return "refused"

    assert python(None) == cpp((-1, -1))
    if (start, stop) != (-1, 0):  # (-1, -1) means all layers, range(-1, 0) is invalid
        assert python(range(start, stop)) == cpp((start, stop - 1))


@PROPERTY
@given(st.booleans(), st.data())
def test_resolve_matches_reference(inclusive, data):
    ranges = CPP_PAIRS if inclusive else PY_RANGES
    src_range, dst_range = data.draw(ranges | st.none()), data.draw(ranges | st.none())
    src_tensors, dst_tensors = data.draw(NUM_TENSORS), data.draw(NUM_TENSORS)
    n = data.draw(TENSOR_NUM_PER_LAYER)
    result = same_outcome(
        lambda: _core.resolve_layer_ranges(src_range, dst_range, src_tensors, dst_tensors, n,
                                           inclusive),
        lambda: ref.resolve_layer_ranges(src_range, dst_range, src_tensors, dst_tensors, n,
                                         inclusive))
    if result is not None:
        src, dst = result
        assert len(src) == len(dst)
        assert_whole_layers(src, src_tensors, n)
        assert_whole_layers(dst, dst_tensors, n)


# ------------------------------------------------------------------------------------------------
# The spec's examples
# ------------------------------------------------------------------------------------------------

def test_push_kv_blocks_example_selects_tensor_3():
    """§16.1: a cache of 4 tensors, ranges (3, 3), tensor_num_per_layer 1 -> exactly tensor 3."""
    assert _core.inclusive_layer_range_to_tensor_indices((3, 3), 4, 1) == [3]
    assert _core.resolve_layer_ranges((3, 3), (3, 3), 4, 4, 1, inclusive=True) == ([3], [3])


@pytest.mark.parametrize("n, expected", [(1, [0, 1, 2, 3]), (2, [0, 1, 2, 3]), (4, [0, 1, 2, 3])])
def test_cpp_minus_one_pair_is_all_layers(n, expected):
    assert _core.inclusive_layer_range_to_tensor_indices((-1, -1), 4, n) == expected
    assert _core.resolve_layer_ranges(None, None, 4, 4, n, inclusive=True) == (expected, expected)


def test_python_layer_zero_is_k0_v0():
    """§16.2: range(0, 1) with the default N = 2 selects K0 and V0."""
    assert _core.layer_range_to_tensor_indices(range(0, 1), 4) == [0, 1]
    assert _core.layer_range_to_tensor_indices(range(0, 1), 4, 2) == [0, 1]


def test_python_ranges_resolve_to_their_layers():
    assert _core.resolve_layer_ranges(range(0, 1), range(1, 2), 4, 4) == ([0, 1], [2, 3])
    assert _core.resolve_layer_ranges(None, None, 6, 6) == ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    assert _core.resolve_layer_ranges(range(1, 3), None, 8, 4) == ([2, 3, 4, 5], [0, 1, 2, 3])


def test_default_n_need_not_divide_the_tensor_count():
    """Only a non-default tensor_num_per_layer must divide num_tensors (§12.1, §16.1)."""
    assert _core.layer_range_to_tensor_indices(None, 5) == [0, 1, 2, 3]
    assert _core.inclusive_layer_range_to_tensor_indices((-1, -1), 5) == [0, 1, 2, 3]
    assert _core.inclusive_layer_range_to_tensor_indices((1, 1), 5) == [2, 3]
    assert _core.layer_range_to_tensor_indices(range(1, 2), 6, 3) == [3, 4, 5]


@pytest.mark.parametrize("layer_range, num_tensors, n, bad", [
    (range(0, 2, 2), 4, 2, "range(0, 2, 2)"),     # step != 1
    (range(1, 1), 4, 2, "range(1, 1)"),          # start == stop
    (range(2, 1), 4, 2, "range(2, 1)"),          # start > stop
    (range(0, 3), 4, 2, "range(0, 3)"),          # stop beyond the 2 layers
    (range(-1, 1), 4, 2, "range(-1, 1)"),        # negative start
    (None, 4, 0, 0),                             # N = 0
    (None, 4, -1, -1),                           # N < 0
    (None, 4, 5, 5),                             # N > num_tensors
    (range(0, 1), 4, 3, 3),                      # non-default N not dividing num_tensors
    (None, 0, 2, 2),                             # no tensors at all
    (None, 1, 2, 2),                             # default N > num_tensors
    (None, 4, True, True),                       # N must be an int, not a bool
    ((0, 1), 4, 2, "tuple"),                     # not a range
])
def test_invalid_python_ranges(layer_range, num_tensors, n, bad):
    assert_both_refuse(lambda: _core.layer_range_to_tensor_indices(layer_range, num_tensors, n),
                       lambda: ref.layer_range_to_tensor_indices(layer_range, num_tensors, n), bad)


@pytest.mark.parametrize("pair, num_tensors, n, bad", [
    ((-1, 1), 4, 2, "(-1, 1)"),                  # -1 mixed with a layer
    ((1, -1), 4, 2, "(1, -1)"),
    ((1, 0), 4, 2, "(1, 0)"),                    # first > second
    ((0, 2), 4, 2, "(0, 2)"),                    # second > max_layer (1)
    ((4, 4), 4, 1, "(4, 4)"),                    # first > max_layer (3)
    ((-2, -2), 4, 2, "(-2, -2)"),
    ((0, 0), 4, 0, 0),                           # N = 0
    ((0, 0), 6, 4, 4),                           # non-default N not dividing num_tensors
    ((0, 0), 2, 3, 3),                           # N > num_tensors
    ((0,), 4, 2, "(0,)"),                        # not a pair
    ("ab", 4, 2, "'ab'"),
    (None, 4, 2, "None"),                        # only resolve_layer_ranges maps None to (-1, -1)
])
def test_invalid_cpp_pairs(pair, num_tensors, n, bad):
    assert_both_refuse(lambda: _core.inclusive_layer_range_to_tensor_indices(pair, num_tensors, n),
                       lambda: ref.inclusive_layer_range_to_tensor_indices(pair, num_tensors, n), bad)


@pytest.mark.parametrize("src_range, dst_range, src_tensors, dst_tensors, inclusive", [
    (range(0, 1), range(0, 2), 4, 4, False),     # unequal spans
    (None, range(0, 1), 4, 4, False),            # all (2 layers) vs 1 layer
    (None, None, 4, 6, False),                   # different layer counts
    ((0, 0), (0, 1), 4, 4, True),
    ((-1, -1), (1, 1), 4, 4, True),
    (None, (0, 0), 4, 4, True),
])
def test_unequal_spans_are_refused(src_range, dst_range, src_tensors, dst_tensors, inclusive):
    with pytest.raises(LLMException) as info:
        _core.resolve_layer_ranges(src_range, dst_range, src_tensors, dst_tensors, 2, inclusive)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "spans" in info.value.args[0]
    with pytest.raises(ValueError):
        ref.resolve_layer_ranges(src_range, dst_range, src_tensors, dst_tensors, 2, inclusive)
