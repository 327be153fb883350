"""The input checks computed in one pass per tensor and read back once (issue 32) decide exactly
what a token-by-token loop decides: the loops here are the reference, over values chosen to hit
every edge of the bit-pattern tests (-0.0, NaN of either sign, infinities, denormals, rounding)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import creditrl.utils.validate as validate
from creditrl import compute_advantages
from creditrl.core.estimators import ENERGY_TOLERANCE
from creditrl.utils.validate import check_mask

NEG_NAN = -float("nan")          # on x86 the NaN of an invalid operation has its sign bit set
SPECIAL = [0.0, 1.0, -0.0, 0.5, 2.0, -1.0, float("nan"), NEG_NAN, float("inf"), -float("inf"), 1e-30, 1e-45,
           0.99999994, 1.0000001, -1e-8, 3e38,
           # each dtype's smallest subnormal and largest value below 1 (bf16, fp16, float64)
           2.0 ** -133, 1 - 2.0 ** -8, 2.0 ** -24, 1 - 2.0 ** -11, 5e-324, 1 - 2.0 ** -53]


def float32_values(draw_from: list[float]):
    return st.lists(st.sampled_from(draw_from), min_size=1, max_size=12)


def loop_is_0_1(values: list[float], dtype: torch.dtype) -> bool:
    """The mask rule in a loop, on the values as ``dtype`` holds them: 0 (either sign) or 1."""
    held = torch.tensor(values, dtype=torch.float64).to(dtype).tolist()
    return all(v in (0, 1) for v in held)


@settings(max_examples=150, deadline=None)
@given(values=float32_values(SPECIAL), rows=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.float64,
                                                                                       torch.bfloat16, torch.float16]),
       strided=st.booleans())
def test_mask_rule_matches_a_loop(values, rows, dtype, strided):
    mask = torch.tensor(values, dtype=torch.float64).to(dtype).repeat(rows, 1)
    if strided:                                                   # a non-contiguous view is checked alike
        wide = torch.zeros(rows, 2 * len(values), dtype=dtype)
        wide[:, ::2] = mask
        mask = wide[:, ::2]
    if loop_is_0_1(values, dtype):
        assert check_mask("mask", mask) is mask
    else:
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[0"):
            check_mask("mask", mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("steps", [2, 4096, 70_000])
def test_a_value_just_below_1_is_caught_in_rows_of_any_length(dtype, steps):
    """The largest value below 1 (and one a few ulps lower, and one ulp above 1) among many ones: a row sum rounds it to
    an integer (float32: 0.999 passed a sum == count test in rows of 65,536); the rule does not.
    Chunked on a CPU, so the bad value sits in the last chunk, the first, and alone in a column."""
    below = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8,
             torch.float16: 2.0 ** -11}[dtype]
    for value in (1 - below, 1 - 8 * below, 1 + 2 * below):      # 2 * below: one ulp above 1
        for row, col in ((0, 0), (40, steps - 1), (40, steps // 2)):
            mask = torch.ones(41, steps, dtype=dtype)
            mask[row, col] = value
            assert mask[row, col].item() == value != 1
            with pytest.raises(ValueError, match=rf"in rows \[{row}\]"):
                check_mask("mask", mask)
            mask[row, col] = 1
            assert check_mask("mask", mask) is mask


def test_a_float_mask_that_requires_grad_is_checked_like_any_other():
    mask = torch.ones(3, 4, requires_grad=True)
    assert check_mask("mask", mask) is mask
    with pytest.raises(ValueError, match=r"in rows \[1\]"):
        check_mask("mask", torch.tensor([[1.0, 0.0], [0.5, 1.0]], requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn, torch.uint16, torch.uint32, torch.uint64])
def test_a_mask_dtype_the_rule_cannot_read_is_a_type_error_naming_it(dtype):
    mask = torch.ones(2, 3).to(dtype)
    group = torch.zeros(2, dtype=torch.long)
    for call in (lambda: check_mask("mask", mask),
                 lambda: compute_advantages("grpo", rewards=torch.ones(2), mask=mask, group=group)):
        with pytest.raises(TypeError, match=rf"mask: expected a bool or 0/1 mask of dtype .* got dtype {dtype}"):
            call()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_masks_need_one_min_max(dtype):
    ok = torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=dtype)
    assert check_mask("mask", ok) is ok
    bad = ok.clone()
    bad[1, 2] = 2
    with pytest.raises(ValueError, match=r"in rows \[1\]"):
        check_mask("mask", bad)
    if dtype.is_signed:
        bad[1, 2] = -1
        with pytest.raises(ValueError, match=r"in rows \[1\]"):
            check_mask("mask", bad)


def count_reads(monkeypatch) -> list[int]:
    """Count the one host read of every ``FusedChecks.run``."""
    reads = []
    run = validate.FusedChecks.run

    def counted(self):
        if self._pending:                          # nothing queued: nothing is read
            reads.append(len(self._pending))
        return run(self)
    monkeypatch.setattr(validate.FusedChecks, "run", counted)
    return reads


def test_compute_advantages_checks_every_input_in_one_read(monkeypatch):
    """mask, token rewards, energy and IS weights: four checks, one read."""
    reads = count_reads(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(8, 6, generator=gen) < 0.8).float()
    compute_advantages("otb", rewards=torch.randn(8, 6, generator=gen) * mask, mask=mask,
                       group=torch.arange(8) // 4, energy=torch.rand(8, 6, generator=gen),
                       is_weights=torch.rand(8, 6, generator=gen))
    assert reads == [4]


@settings(max_examples=120, deadline=None)
@given(valid_values=float32_values(SPECIAL), masked_values=float32_values(SPECIAL), seed=st.integers(0, 99))
def test_energy_check_matches_a_loop(valid_values, masked_values, seed):
    """Energies: finite and >= 0 on valid tokens (rounding below 0 clamped), anything off the mask."""
    steps = len(valid_values) + len(masked_values)
    order = torch.randperm(steps, generator=torch.Generator().manual_seed(seed))
    energy = torch.tensor(valid_values + masked_values, dtype=torch.float32)[order][None]
    mask = (order < len(valid_values))[None]
    tolerance = ENERGY_TOLERANCE * torch.finfo(torch.float32).eps
    held = torch.tensor(valid_values, dtype=torch.float32).tolist()
    good = all(math.isfinite(v) and v >= -tolerance for v in held)
    args = dict(rewards=torch.ones(1), mask=mask, group=torch.zeros(1, dtype=torch.long), energy=energy)
    if good:
        out = compute_advantages("otb", **args)                   # a singleton: advantage 0 on valid tokens
        assert torch.equal(out, torch.zeros_like(out))
    else:
        with pytest.raises(ValueError, match="energy: "):
            compute_advantages("otb", **args)


# ----------------------------------------------------------------------------- verl's plug-in

verl = pytest.importorskip("verl")
from creditrl.integrations.verl import LOGP_TOLERANCE, check_actor_stats, group_ids  # noqa: E402

ACTOR = [0.0, -0.0, 0.5, 1.0, 1.0005, 1.002, -0.5, -3.0, float("nan"), NEG_NAN, float("inf"), -float("inf"),
         1e-45, -1e-45, 5.0, -20.0]


def loop_actor_ok(logp: list[float], sum_p2: list[float]) -> tuple[bool, bool]:
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32).tolist()   # noqa: E731
    high = float(torch.tensor(1.0 + LOGP_TOLERANCE, dtype=torch.float32))
    return (all(v <= float(torch.tensor(LOGP_TOLERANCE, dtype=torch.float32)) for v in f32(logp)),
            all(0 < v <= high for v in f32(sum_p2)))


@settings(max_examples=200, deadline=None)
@given(valid=st.lists(st.tuples(st.sampled_from(ACTOR), st.sampled_from(ACTOR)), min_size=1, max_size=8),
       masked=st.lists(st.tuples(st.sampled_from(ACTOR), st.sampled_from(ACTOR)), max_size=8),
       mask_dtype=st.sampled_from([torch.float32, torch.bool, torch.int64]), seed=st.integers(0, 99))
def test_actor_stats_check_matches_a_loop(valid, masked, mask_dtype, seed):
    """old_log_probs <= 0 and sum_pi_squared in (0, 1] (within LOGP_TOLERANCE) on valid tokens
    only, whatever the padding holds (verl pads with 0), for every mask dtype verl may pass."""
    pairs = valid + masked
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))
    logp = torch.tensor([p[0] for p in pairs], dtype=torch.float32)[order][None]
    sum_p2 = torch.tensor([p[1] for p in pairs], dtype=torch.float32)[order][None]
    mask = (order < len(valid))[None].to(mask_dtype)
    logp_ok, p2_ok = loop_actor_ok([p[0] for p in valid], [p[1] for p in valid])
    if logp_ok and p2_ok:
        check_actor_stats(mask, logp, sum_p2)
    else:
        with pytest.raises(ValueError, match="old_log_probs" if not logp_ok else "sum_pi_squared"):
            check_actor_stats(mask, logp, sum_p2)


def test_actor_stats_take_one_read_zero_padding_included(monkeypatch):
    """float32 sum_pi_squared is tested on the valid tokens straight away (verl pads it with 0, outside
    (0, 1]); other dtypes try every token first."""
    reads = count_reads(monkeypatch)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    check_actor_stats(mask, torch.tensor([[-1.0, -0.5, -2.0]]), torch.tensor([[0.5, 0.9, 0.3]]))
    assert reads == [2]
    check_actor_stats(mask, torch.tensor([[-1.0, -0.5, 0.0]]), torch.tensor([[0.5, 0.9, 0.0]]))
    assert reads == [2, 2]                           # sum_pi_squared's zero padding: no second read
    check_actor_stats(mask, torch.tensor([[-1.0, -0.5, 0.0]]), torch.tensor([[0.5, 0.9, 0.0]], dtype=torch.float64))
    assert reads == [2, 2, 2, 1]                     # float64: every token, then the valid ones
    scratch = torch.full((1, 3), 7.0)
    check_actor_stats(mask, torch.tensor([[-1.0, -0.5, 0.0]]), torch.tensor([[0.5, 0.9, 0.0]]), scratch=scratch)
    assert reads == [2, 2, 2, 1, 2] and not bool((scratch == 7.0).any())   # the integer pass went into scratch


@settings(max_examples=60, deadline=None)
@given(uids=st.lists(st.sampled_from(["a", "b", "c", "uid-10", "uid-2"]), min_size=1, max_size=12),
       blocks=st.booleans(), numeric=st.booleans())
def test_group_ids_match_a_loop_over_uids(uids, blocks, numeric):
    """Same uid <=> same id, ids dense in 0..G-1, for uids in contiguous blocks (verl's layout, the
    neighbour-comparison path) and in any order (np.unique's)."""
    if blocks:
        uids = sorted(uids, key=uids.index)           # each uid's rows together, in first-seen order
    values = [sum(map(ord, u)) for u in uids] if numeric else uids
    index = np.array(values, dtype=np.int64 if numeric else object)
    ids = group_ids(index, len(uids), torch.device("cpu")).tolist()
    first = {}
    for uid, got in zip(values, ids):
        first.setdefault(uid, got)
        assert got == first[uid]
    assert sorted(first.values()) == list(range(len(first)))


def test_group_ids_refuse_missing_uids():
    with pytest.raises(ValueError, match=r"None/NaN at rows \[1\]"):
        group_ids(np.array([1.0, float("nan"), 2.0]), 3, torch.device("cpu"))
