"""The input checks computed in one pass per tensor and read back once (issue 32), and the actor
statistics' check fused into the energy's compiled pass, decide exactly what a token-by-token loop
decides: the loops here are the reference, over values chosen to hit every edge (-0.0, NaN of
either sign, infinities, denormals, rounding, values just past each bound)."""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import creditrl.utils.fused as fused_module
import creditrl.utils.validate as validate
from creditrl import compute_advantages, list_estimators, register_estimator
from creditrl.core.estimators import ENERGY_TOLERANCE, get_estimator
from creditrl.core.estimators.registry import _REGISTRY
from creditrl.integrations.energy import checked_energy_from_logp, energy_from_logp
from creditrl.utils.validate import LOGP_TOLERANCE, check_mask

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


# ----------------------------------------------------------------------------- actor stats -> energy

ACTOR = [0.0, -0.0, 0.5, 1.0, 1.0005, 1.002, -0.5, -3.0, float("nan"), NEG_NAN, float("inf"), -float("inf"),
         1e-45, -1e-45, 5.0, -20.0]


def loop_actor_ok(logp: list[float], sum_p2: list[float]) -> tuple[bool, bool]:
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32).tolist()   # noqa: E731
    high = float(torch.tensor(1.0 + LOGP_TOLERANCE, dtype=torch.float32))
    return (all(v <= float(torch.tensor(LOGP_TOLERANCE, dtype=torch.float32)) for v in f32(logp)),
            all(0 < v <= high for v in f32(sum_p2)))


def actor_case(valid: list, masked: list, mask_dtype: torch.dtype, seed: int):
    """(logp, sum_p2, mask) [1, n] with the ``valid`` pairs on the mask and the ``masked`` ones off
    it, shuffled, and the loop's verdicts on the valid pairs (logp ok, sum_p2 ok)."""
    pairs = valid + masked
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))
    logp = torch.tensor([p[0] for p in pairs], dtype=torch.float32)[order][None]
    sum_p2 = torch.tensor([p[1] for p in pairs], dtype=torch.float32)[order][None]
    mask = (order < len(valid))[None].to(mask_dtype)
    return (logp, sum_p2, mask, *loop_actor_ok([p[0] for p in valid], [p[1] for p in valid]))


def loop_energy(logp: list[float], sum_p2: list[float]) -> list[float]:
    """OTB eq. 7 element by element in float64, clamped at 0."""
    return [max(0.0, 1.0 - 2.0 * math.exp(lp) + s) if math.isfinite(1.0 - 2.0 * math.exp(min(lp, 700.0)) + s)
            else float("nan") for lp, s in zip(logp, sum_p2)]


def fused_kernels() -> list:
    """Every fused function creditrl defines (utils.validate, integrations.energy, the TRL hook's sums)."""
    from creditrl.integrations import energy, trl
    return [validate._times_mask_with_rule_fused, validate._row_sums_with_rule_fused,
            validate._non_negative_range_and_rule_fused, energy._energy_fused, energy._energy_and_ranges_fused,
            energy._energy_ranges_and_rule_fused, trl._energy_sums]


def skip_where_compiling_fails() -> None:
    """Skip a test of the compiled paths where compiling failed in this process (the eager cases run)."""
    if fused_module._EAGER_REASON:
        pytest.skip(f"torch.compile fails here ({fused_module._EAGER_REASON[0]})")


@pytest.fixture(params=["standalone", "dynamo", "eager"])
def energy_path(request, monkeypatch):
    """Each test runs through the kernel compiled without dynamo (a CPU's contiguous tensors), through
    ``torch.compile`` (every other call) and through the eager fallback (compiling failed). On the
    standalone path no kernel may have fallen back to torch.compile, which would test that path twice."""
    if request.param == "eager":
        monkeypatch.setattr(fused_module, "_EAGER_REASON", ["forced by the test"])
    else:
        if request.param == "dynamo":
            monkeypatch.setattr(fused_module, "signature", lambda args: None)
            monkeypatch.setattr(fused_module, "exact_key", lambda args: None)   # no graph served before either
        checked_energy_from_logp(-torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3))
        if fused_module._EAGER_REASON:
            pytest.skip(f"torch.compile fails here ({fused_module._EAGER_REASON[0]}): the eager case covers it")
    yield request.param
    if request.param == "standalone":
        assert not [kernel.standalone_failed for kernel in fused_kernels() if kernel.standalone_failed]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid=st.lists(st.tuples(st.floats(-30.0, 0.0, width=32), st.floats(2.0 ** -20, 1.0, width=32)), min_size=1,
                      max_size=10),
       rows=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_energy_matches_a_loop(energy_path, device, valid, rows, dtype):
    """w_t = 1 - 2 exp(logp) + sum_p2 >= 0 (OTB eq. 7) to float32 rounding, from any float dtype.
    Tolerance: |w| <= 3, exp to ~1 ulp, three float32 roundings of values <= 3: under 8 ulps of 3."""
    logp = torch.tensor([v[0] for v in valid], dtype=torch.float64).to(dtype).repeat(rows, 1)
    sum_p2 = torch.tensor([v[1] for v in valid], dtype=torch.float64).to(dtype).repeat(rows, 1)
    want = torch.tensor(loop_energy(logp.double().flatten().tolist(), sum_p2.double().flatten().tolist()),
                        dtype=torch.float64).view(logp.shape)
    got = energy_from_logp(logp.to(device), sum_p2.to(device))
    assert got.dtype == torch.float32 and got.device.type == device.type
    assert bool((got >= 0).all())
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=8 * 3 * torch.finfo(torch.float32).eps)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid=st.lists(st.tuples(st.sampled_from(ACTOR), st.sampled_from(ACTOR)), min_size=1, max_size=8),
       masked=st.lists(st.tuples(st.sampled_from(ACTOR), st.sampled_from(ACTOR)), max_size=8),
       mask_dtype=st.sampled_from([torch.float32, torch.bool, torch.int64]), seed=st.integers(0, 99))
def test_checked_energy_decides_as_a_loop(energy_path, valid, masked, mask_dtype, seed):
    """The range test fused into the energy's pass: logp <= 0 and sum_p2 in (0, 1] (within
    LOGP_TOLERANCE) on valid tokens only, whatever the padding holds; the error names the
    argument as verl does; on success the energy is the unchecked function's on the valid tokens and
    0 on the others, whatever they hold, so every energy is finite and >= 0 (``with_energy(checked=True)``)."""
    logp, sum_p2, mask, logp_ok, p2_ok = actor_case(valid, masked, mask_dtype, seed)
    if logp_ok and p2_ok:
        energy = checked_energy_from_logp(logp, sum_p2, mask)
        want = [[e if m != 0 else 0.0 for e, m in zip(row, mask_row)]
                for row, mask_row in zip(energy_from_logp(logp, sum_p2).tolist(), mask.double().tolist())]
        torch.testing.assert_close(energy, torch.tensor(want), rtol=0, atol=0)
        assert bool(torch.isfinite(energy).all() and (energy >= 0).all())
    else:
        with pytest.raises(ValueError, match="old_log_probs" if not logp_ok else "sum_pi_squared"):
            checked_energy_from_logp(logp, sum_p2, mask)


def test_energy_refuses_bad_arguments_and_takes_empty_batches():
    with pytest.raises(ValueError, match=r"sum_p2: expected logp's shape \[2, 3\], got \[2, 2\]"):
        energy_from_logp(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="logp: expected a floating-point tensor, got torch.int64"):
        energy_from_logp(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"valid: expected logp's shape \[2, 3\], got \[3\]"):
        checked_energy_from_logp(torch.zeros(2, 3), torch.ones(2, 3), torch.ones(3))
    empty = checked_energy_from_logp(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3))
    assert empty.shape == (0, 3) and empty.dtype == torch.float32


def compile_that_raises(monkeypatch, message: str) -> None:
    """``torch.compile`` and the compiler of standalone graphs replaced by ones whose compiled calls
    raise RuntimeError(message), compiling on."""
    def broken(fn, *args, **kwargs):
        def call(*args):
            raise RuntimeError(message)
        return call
    monkeypatch.setattr(fused_module, "_EAGER_REASON", [])
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fused_module, "_standalone", broken)


def test_a_failed_compilation_falls_back_to_eager_once_and_says_so(monkeypatch):
    compile_that_raises(monkeypatch, "no C++ compiler\nsecond line")
    double = fused_module.fused(lambda x: 2 * x)
    with pytest.warns(RuntimeWarning, match=r"torch.compile failed \(RuntimeError: no C\+\+ compiler second line\); "
                                             r".* eagerly"):
        assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # once per process
        assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))


def test_a_callers_error_raises_as_itself_and_leaves_compiling_on(monkeypatch):
    """A compiled call that fails on an input the eager function refuses too is the caller's error:
    it raises unchanged, with no warning, and compiling stays on."""
    compile_that_raises(monkeypatch, "compiled: shapes do not broadcast")
    add = fused_module.fused(lambda x, y: x + y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="must match the size"):
            add(torch.ones(2), torch.ones(3))
    assert fused_module._EAGER_REASON == []


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_a_kernel_compiled_on_a_tiny_batch_runs_in_parallel_on_any_batch():
    """inductor sizes a CPU kernel's parallelism from the shapes it first compiles for, and its graph
    cache serves that kernel to every later process: the energy compiled on a 3 x 5 batch ran
    single-threaded, 1.7x slower, on B = 1,024, T = 4,096. ``fused`` compiles with dynamic threads,
    so the loop is an OpenMP parallel one whatever the first shapes (the cache is off here, so the
    kernel is generated, not loaded)."""
    from torch._inductor.utils import run_and_get_code
    skip_where_compiling_fails()
    square_sum = fused_module.fused(lambda x: (x * x).sum().reshape(1))
    with torch._inductor.config.patch(force_disable_caches=True):
        out, code = run_and_get_code(square_sum, torch.arange(3.0))
    skip_where_compiling_fails()
    assert out.tolist() == [5.0]
    assert code and any("#pragma omp parallel" in source for source in code), code


def test_energy_compiles_once_for_every_shape():
    """Inputs go in flat, so B and T do not multiply graphs: a handful of shapes (1 element, then
    many) add at most two graphs per dtype combination, and no dynamo graph."""
    from torch._dynamo.utils import counters
    from creditrl.integrations import energy
    skip_where_compiling_fails()
    kernels = (energy._energy_and_ranges_fused, energy._energy_ranges_and_rule_fused)
    before, dynamo_before = [set(kernel.graphs) for kernel in kernels], counters["stats"]["unique_graphs"]
    for rows, steps in [(1, 1), (1, 5), (3, 1), (4, 7), (2, 300), (9, 33)]:
        checked_energy_from_logp(-torch.rand(rows, steps), torch.rand(rows, steps) * 0.9 + 0.05,
                                 torch.ones(rows, steps))
    assert all(len(set(kernel.graphs) - seen) <= 2 and not kernel.standalone_failed
               for kernel, seen in zip(kernels, before))
    assert counters["stats"]["unique_graphs"] == dynamo_before


def test_one_standalone_graph_per_pattern_of_sizes_gives_the_eager_values():
    """A symbolic trace takes sizes 0 and 1 as constants and equal sizes as one symbol; the graphs are
    keyed by that pattern, so a graph traced where B == T, or B == 1, never serves a call where it is
    not so. Each call equals the eager function; non-contiguous inputs go through torch.compile."""
    skip_where_compiling_fails()

    def scaled_rows(per_row, x):
        return per_row[:, None] * x, (x * x).sum(-1).sum().reshape(1)
    kernel = fused_module.fused(scaled_rows)
    gen = torch.Generator().manual_seed(0)
    for rows, steps in [(4, 4), (3, 5), (5, 3), (1, 6), (6, 1), (1, 1), (4, 4), (7, 7), (0, 3)]:
        per_row, x = torch.randn(rows, generator=gen), torch.randn(rows, steps, generator=gen)
        for got, want in zip(kernel(per_row, x), scaled_rows(per_row, x)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # six patterns: (4, 4) and (7, 7) share one, as do (3, 5) and (5, 3)
    assert len(kernel.graphs) == 6 and not kernel.standalone_failed
    x = torch.randn(6, 4, generator=gen)
    for got, want in zip(kernel(x[0], x.t()), scaled_rows(x[0], x.t())):      # x.t(): [4, 6], not contiguous
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert len(kernel.graphs) == 6
    offset = torch.randn(5 * 3 + 1, generator=gen)[1:].view(5, 3)              # contiguous, storage offset 1
    for got, want in zip(kernel(offset[:, 0].contiguous(), offset), scaled_rows(offset[:, 0].contiguous(), offset)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_a_standalone_graph_ignores_the_callers_autocast_and_grad_mode():
    """A standalone graph runs outside the no_grad context the other paths enter, and enters the
    autocast-off one only where autocast is on: a caller's bf16 autocast and grad mode change neither
    its values (float32, as the eager function computes them without autocast; the matmul is an
    extern kernel, which dispatches through autocast) nor its outputs' autograd state."""
    skip_where_compiling_fails()

    def scaled_rows(per_row, x):
        return per_row[:, None] * x, (x @ x.t()).sum(-1)        # a matmul: autocast would take it to bf16
    kernel = fused_module.fused(scaled_rows)
    gen = torch.Generator().manual_seed(0)
    per_row, x = torch.randn(5, generator=gen), torch.randn(5, 7, generator=gen) * (1 + 2 ** -10)
    want = scaled_rows(per_row, x)
    for _ in range(2):                                          # the compiling call, then a cached graph's
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got = kernel(per_row, x)
        for value, expected in zip(got, want):
            assert value.dtype == torch.float32 and not value.requires_grad
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-5)
    assert len(kernel.graphs) == 1 and not kernel.standalone_failed


def test_a_graph_serves_only_the_sizes_its_trace_assumed():
    """A fused function that branches on a size (not 0, 1 or equality, which the key holds): each
    call equals the eager function, the calls on either side of the branch with a graph of their own."""
    skip_where_compiling_fails()

    def head_or_all(x):
        return (x[:4] if x.shape[0] > 4 else 2 * x).sum().reshape(1)
    kernel = fused_module.fused(head_or_all)
    for n in (10, 3, 2, 10, 5):
        x = torch.arange(float(n))
        assert torch.equal(kernel(x), head_or_all(x)), n
    assert [len(served) for served in kernel.graphs.values()] == [2] and not kernel.standalone_failed


def test_a_graph_found_by_its_exact_key_is_the_one_its_guards_choose(monkeypatch):
    """Calls found by ``exact_key`` skip the guards: each key must map to the graph the guards pick for
    it, repeated calls on either side of a size branch give the eager values, and past
    ``MAX_EXACT_KEYS`` distinct shapes the table starts over instead of growing."""
    skip_where_compiling_fails()
    monkeypatch.setattr(fused_module, "MAX_EXACT_KEYS", 3)

    def head_or_all(x):
        return (x[:4] if x.shape[0] > 4 else 2 * x).sum().reshape(1)
    kernel = fused_module.fused(head_or_all)
    for n in (10, 3, 10, 3, 6, 2, 2, 7, 9, 3, 10):
        x = torch.arange(float(n))
        assert torch.equal(kernel(x), head_or_all(x)), n
        assert len(kernel.hits) <= 3
    assert kernel.hits and not kernel.standalone_failed
    for key, run in kernel.hits.items():
        (dtype, shape, _), = key
        x = torch.empty(shape, dtype=dtype)
        assert run is fused_module._serving(kernel.graphs[fused_module.signature((x,))], (x,))


def test_inductors_size_choices_hold_from_its_graph_cache_too():
    """inductor compiles a float32 sum over more than 4,096 values with cascade summation and one over
    fewer without: a graph compiled on 100 values must not serve 2^20 (its plain loop loses ~100x the
    accuracy there). The condition is a guard of the graph, kept when inductor's on-disk graph cache
    serves the kernel: a second fused function, same code, hits that cache on 100 values and still
    compiles a second graph for 2^20."""
    from torch._dynamo.utils import counters
    skip_where_compiling_fails()

    def total(x):
        return x.sum().reshape(1)
    small, large = torch.ones(100), torch.ones(1 << 20)
    fused_module.fused(total)(small)                  # compiled, into the graph cache
    hits = counters["inductor"]["fxgraph_cache_hit"]
    kernel = fused_module.fused(total)
    assert kernel(small).item() == 100.0
    if counters["inductor"]["fxgraph_cache_hit"] == hits:
        pytest.skip("inductor's graph cache is off here: the cold compile is covered above")
    assert kernel(large).item() == float(1 << 20)
    (served,) = kernel.graphs.values()
    assert len(served) == 2
    assert [holds((small,)) for holds, _ in served] == [True, False]
    assert [holds((large,)) for holds, _ in served] == [False, True]


def test_first_calls_from_two_threads_compile_once_each_and_stay_compiled():
    """Tracing and inductor share process-wide state: two threads making their first calls at once
    (an audit saw every such run fall back to eager for the whole process, with a false "torch.compile
    failed" warning) compile under dynamo's lock. Each call equals the eager function; no warning."""
    import threading
    skip_where_compiling_fails()

    def scaled_rows(per_row, x):
        return per_row[:, None] * x, (x - x * x).abs().amax(-1).amax().reshape(1)
    kernels = [fused_module.fused(scaled_rows) for _ in range(2)]
    wrong, errors, start = [], [], threading.Barrier(4)

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start.wait()
        try:
            for rows, steps in [(3, 5), (4, 4), (1, 9), (6, 2)] * 3:
                per_row, x = torch.randn(rows, generator=gen), torch.rand(rows, steps, generator=gen)
                for kernel in kernels:
                    got, want = kernel(per_row, x), scaled_rows(per_row, x)
                    wrong.extend((seed, rows, steps) for a, b in zip(got, want) if not torch.equal(a, b))
        except Exception as error:   # noqa: BLE001 (any failure of a thread fails the test below)
            errors.append(repr(error))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors and not wrong and fused_module._EAGER_REASON == []
    assert all(kernel.graphs and not kernel.standalone_failed for kernel in kernels)


@pytest.mark.parametrize("switch", ["TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE", "force_eager"])
def test_a_user_who_switches_compiling_off_gets_no_compiled_graph(monkeypatch, switch):
    """TORCHDYNAMO_DISABLE=1, dynamo's config.disable (TORCH_COMPILE_DISABLE=1) and
    torch.compiler.set_stance("force_eager") make torch.compile run functions as they are: the fused
    function then compiles nothing either, and gives the eager values."""
    import torch._dynamo
    double = fused_module.fused(lambda x: 2 * x)
    stance = contextlib.nullcontext()
    if switch == "TORCHDYNAMO_DISABLE":
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    elif switch == "TORCH_COMPILE_DISABLE":
        stance = torch._dynamo.config.patch(disable=True)
    else:
        stance = torch.compiler.set_stance("force_eager")
    with stance:
        assert torch.equal(double(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))
    assert not double.graphs


def test_a_graph_that_cannot_compile_standalone_goes_through_torch_compile(monkeypatch):
    """A trace or compile without dynamo that fails where torch.compile succeeds: the call's result is
    torch.compile's, with no warning, and that function skips the standalone path from then on."""
    skip_where_compiling_fails()

    def untraceable(fn, args):
        raise RuntimeError("data-dependent control flow")
    monkeypatch.setattr(fused_module, "_standalone", untraceable)
    double = fused_module.fused(lambda x: 2 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(double(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))
        assert torch.equal(double(torch.arange(4.0)), torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert double.standalone_failed == ["RuntimeError: data-dependent control flow"] and not double.graphs
    assert fused_module._EAGER_REASON == []


def test_a_fused_function_inside_torch_compile_is_traced_by_it():
    """Under an outer torch.compile (a user's compiled step) the function joins dynamo's graph: the
    compiled function gives the eager values, with no warning, and adds no standalone graph."""
    skip_where_compiling_fails()
    square = fused_module.fused(lambda x: x * x)
    outer = torch.compile(lambda x: square(x + 1) - 1, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert torch.equal(outer(torch.arange(3.0)), torch.tensor([0.0, 3.0, 8.0]))
    assert not square.graphs


# ----------------------------------------------------------------------------- a float32 mask checked in its broadcast


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=float32_values(SPECIAL), rows=st.integers(1, 3), seed=st.integers(0, 99))
def test_the_passes_with_the_mask_rule_match_a_loop(energy_path, values, rows, seed):
    """times_mask_with_rule: the product is per_row * m (one float32 rounding of the exact product,
    as the loop's float64 product rounded once); row_sums_with_rule: a 0/1 mask's row sums, exact.
    The statistics of both pass the verdict iff the loop finds only 0 and 1."""
    mask = torch.tensor(values, dtype=torch.float32).repeat(rows, 1)
    per_row = torch.randn(rows, generator=torch.Generator().manual_seed(seed))
    product, stats = validate.times_mask_with_rule(per_row, mask)
    sums, sum_stats = validate.row_sums_with_rule(mask)
    want = torch.tensor([[p * m for m in mask[r].tolist()] for r, p in enumerate(per_row.tolist())],
                        dtype=torch.float32)
    torch.testing.assert_close(product, want, rtol=0, atol=0, equal_nan=True)
    for statistics in (stats, sum_stats):
        if loop_is_0_1(values, torch.float32):
            validate.mask_verdict("mask", mask, statistics.tolist())
        else:
            with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[0"):
                validate.mask_verdict("mask", mask, statistics.tolist())
    if loop_is_0_1(values, torch.float32):
        assert sums.tolist() == [float(sum(v != 0 for v in mask[0].tolist()))] * rows


@pytest.fixture(params=["deferred", "eager"])
def mask_check(request, monkeypatch):
    """Each test runs with the float32 mask's rule deferred to its first use (as for masks of >= 2^20
    elements; here at any size) and checked in build_batch (smaller masks)."""
    import creditrl.core.estimators as estimators
    if request.param == "deferred":
        monkeypatch.setattr(estimators, "FUSED_RULE_MIN_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("bad", [0.5, float("nan"), 1.0000001, -1e-30, float("inf"), 2.0 ** -149])
def test_every_estimator_refuses_a_bad_float32_mask_naming_its_row(energy_path, mask_check, bad):
    """Without energies a float32 mask's rule waits for the broadcast (or the estimator's first read
    of the mask): whichever way each estimator takes, the same error, and -0.0 passes."""
    from creditrl.core.estimators import prepare
    gen = torch.Generator().manual_seed(0)
    group = torch.arange(4).repeat_interleave(4)
    mask = (torch.rand(16, 7, generator=gen) < 0.7).float()
    mask[:, 0] = 1
    rewards = torch.randint(0, 2, (16,), generator=gen).float()
    energy = torch.rand(16, 7, generator=gen)
    bad_mask, signed_zero = mask.clone(), mask.clone()
    bad_mask[5, 3] = bad
    signed_zero[mask == 0] = -0.0
    for name in list_estimators():
        spec = get_estimator(name)
        given = dict(rewards=rewards, group=group, energy=energy if spec.needs_energy else None,
                     **({} if spec.k_range is None else {"k": 2}))
        assert prepare(name, mask=mask, **{k: v for k, v in given.items() if k != "k"},
                       defer_mask_check=True).mask_pending == (mask_check == "deferred" and given["energy"] is None)
        want = compute_advantages(name, mask=mask, **given)
        torch.testing.assert_close(compute_advantages(name, mask=signed_zero, **given), want, rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[5\]"):
            compute_advantages(name, mask=bad_mask, **given)


@pytest.mark.parametrize("name", ["reinforce", "reinforce_plus_plus", "grpo"])
def test_token_rewards_on_the_last_token_check_a_deferred_mask_first(mask_check, name):
    """Outcome rewards as verl passes them (on each row's last valid token, with holes): the
    ``constant_returns`` test reads the mask's last valid columns, after the mask's rule has run."""
    mask = torch.ones(8, 6)
    mask[:, 2] = 0.0
    mask[:, 5] = 0.0
    rewards = torch.zeros(8, 6)
    rewards[:, 4] = (torch.arange(8) % 2).float()
    group = torch.arange(8) // 4
    want = compute_advantages(name, rewards=rewards[:, 4], mask=mask, group=group)
    torch.testing.assert_close(compute_advantages(name, rewards=rewards, mask=mask, group=group), want)
    mask[6, 1] = 0.5
    with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[6\]"):
        compute_advantages(name, rewards=rewards, mask=mask, group=group)


def test_the_public_building_blocks_return_nothing_from_an_unchecked_mask(mask_check):
    """estimator_output, and prepare + estimator_result, hand back per-row results: the mask is
    checked before they return, whatever compute_advantages defers."""
    from creditrl.core.estimators import estimator_output, estimator_result, prepare
    mask = torch.ones(8, 5)
    mask[6, 2] = float("nan")
    given = dict(rewards=torch.arange(8.0), mask=mask, group=torch.arange(8) // 4)
    for call in (lambda: estimator_output("grpo", **given), lambda: estimator_result("grpo", prepare("grpo", **given))):
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[6\]"):
            call()


@pytest.mark.parametrize("case", ["estimator's own error", "k out of range", "components off the rewards",
                                  "non-finite rewards", "token rewards beyond float32"])
def test_a_bad_masks_error_comes_before_another_inputs(mask_check, case):
    """With the mask's rule deferred, another input's error found first (an estimator's own, the K
    range, gdpo's components) still comes after the mask's, as when build_batch checks it up front."""
    mask = torch.ones(8, 5)
    mask[3, 1] = float("nan")
    rewards, group = (torch.arange(8) % 2).float(), torch.arange(8) // 4
    given = {"estimator's own error": dict(name="passk_chen", rewards=rewards * 0.5, k=2),
             "k out of range": dict(name="maxk_bon", rewards=rewards, k=5),
             "components off the rewards": dict(name="gdpo", rewards=rewards,
                                                components=torch.full((8, 1), 3.0, dtype=torch.float64)),
             "non-finite rewards": dict(name="grpo", rewards=torch.where(rewards > 0, float("nan"), 0.0)),
             "token rewards beyond float32": dict(name="grpo", rewards=torch.full((8, 5), 3e38))}[case]
    with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[3\]"):
        compute_advantages(mask=mask, group=group, **given)
    mask[3, 1] = 1.0                     # the other error is still there once the mask is good
    with pytest.raises(ValueError, match=r"passk_chen|k=5|components|rewards"):
        compute_advantages(mask=mask, group=group, **given)


def test_inputs_with_grad_give_the_same_advantages_as_data(mask_check):
    """Advantages are data (as in verl and TRL): rewards or a mask that require grad are read detached, in the
    deferred check's compiled pass as in the eager one, and the result has no graph."""
    rewards = torch.arange(8.0)
    mask = (torch.arange(40).reshape(8, 5) % 3 != 0).float()
    want = compute_advantages("dr_grpo", rewards=rewards, mask=mask, group=torch.arange(8) // 4)
    adv = compute_advantages("dr_grpo", rewards=rewards.clone().requires_grad_(), mask=mask.clone().requires_grad_(),
                             group=torch.arange(8) // 4)
    assert not adv.requires_grad and torch.equal(adv, want)


@pytest.mark.parametrize("module", ["tests.plugin", "creditrl.core.estimators.test_only"], ids=["plug-in", "built-in"])
def test_a_token_level_result_that_never_read_the_mask_is_checked_before_it_leaves(mask_check, module):
    """An estimator whose [B,T] masked_output result comes from the token rewards, never from the
    mask: a plug-in's mask is checked before it runs (only built-ins defer the check), and a built-in's
    deferred one in ``on_tokens`` (every built-in reads the mask today; this guards the next)."""
    def token_rewards(batch):
        return batch.token_rewards
    token_rewards.__module__ = module                # creditrl.* counts as built-in: may defer
    register_estimator("test_token_rewards_as_advantages", token_level=True, masked_output=True,
                       overwrite=True)(token_rewards)
    try:
        mask = torch.ones(4, 3)
        mask[1, 2] = 0.5
        mask[2, 0] = 2.0
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[1, 2\]"):
            compute_advantages("test_token_rewards_as_advantages", rewards=torch.ones(4, 3), mask=mask,
                               group=torch.zeros(4).long())
    finally:
        _REGISTRY.pop("test_token_rewards_as_advantages")


def test_an_estimator_that_reads_the_mask_reads_it_checked(mask_check):
    """A third party's estimator reading ``batch.given_mask`` never sees an unchecked float32 mask."""
    seen = []

    @register_estimator("test_reads_given_mask", overwrite=True)
    def reads_mask(batch):
        seen.append(batch.given_mask)
        return batch.rewards
    try:
        mask = torch.ones(4, 3)
        mask[2, 1] = 0.25
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[2\]"):
            compute_advantages("test_reads_given_mask", rewards=torch.ones(4), mask=mask, group=torch.zeros(4).long())
        assert seen == []
    finally:
        _REGISTRY.pop("test_reads_given_mask")


# ----------------------------------------------------------------------------- verl's plug-in

verl = pytest.importorskip("verl")
from creditrl.integrations.verl import check_actor_stats, group_ids  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(valid=st.lists(st.tuples(st.sampled_from(ACTOR), st.sampled_from(ACTOR)), min_size=1, max_size=8),
       masked=st.lists(st.tuples(st.sampled_from(ACTOR), st.sampled_from(ACTOR)), max_size=8),
       mask_dtype=st.sampled_from([torch.float32, torch.bool, torch.int64]), seed=st.integers(0, 99))
def test_actor_stats_check_matches_a_loop(valid, masked, mask_dtype, seed):
    """old_log_probs <= 0 and sum_pi_squared in (0, 1] (within LOGP_TOLERANCE) on valid tokens
    only, whatever the padding holds (verl pads with 0), for every mask dtype verl may pass, as the
    plug-in calls it."""
    logp, sum_p2, mask, logp_ok, p2_ok = actor_case(valid, masked, mask_dtype, seed)
    if logp_ok and p2_ok:
        check_actor_stats(mask, logp, sum_p2)
    else:
        with pytest.raises(ValueError, match="old_log_probs" if not logp_ok else "sum_pi_squared"):
            check_actor_stats(mask, logp, sum_p2)


def test_actor_stats_are_checked_in_the_energys_pass():
    """Both given: the check returns their energy (the same as the unchecked function's), verl's 0
    padding off the response untested; one alone (an estimator that needs no energy) is only checked."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    logp, sum_p2 = torch.tensor([[-1.0, -0.5, 0.0]]), torch.tensor([[0.5, 0.9, 0.0]])
    energy = check_actor_stats(mask, logp, sum_p2)
    assert torch.equal(energy, energy_from_logp(logp, sum_p2))
    assert check_actor_stats(mask, logp, None) is None and check_actor_stats(mask, None, sum_p2) is None
    with pytest.raises(ValueError, match="sum_pi_squared: expected values in"):
        check_actor_stats(mask, None, torch.tensor([[0.5, 1.5, 0.0]]))
    with pytest.raises(ValueError, match=r"old_log_probs: expected a tensor of response_mask's shape \[1, 3\]"):
        check_actor_stats(mask, torch.zeros(1, 2), sum_p2)


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


@pytest.mark.parametrize("bad", [None, 0.5, float("nan"), 1.0000001, -1e-30, 2.0 ** -149])
def test_the_plugins_float32_mask_is_checked_in_the_energys_pass(energy_path, mask_check, bad):
    """verl's creditrl_otb with a float32 mask: deferred (masks >= 2^20 elements; here any), its rule
    runs in the actor stats' energy pass, and a bad mask's error comes before a bad actor stat's; a
    good mask, -0.0 on masked tokens included, gives the advantages of the same mask as bool."""
    from verl.trainer.ppo import core_algos
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(8, 5, generator=gen) < 0.7).float()
    mask[:, 0] = 1
    mask[mask == 0] = -0.0
    logp = -torch.rand(8, 5, generator=gen) * 2 * mask
    sum_p2 = (0.2 + 0.7 * torch.rand(8, 5, generator=gen)) * mask
    rewards = torch.zeros(8, 5)
    rewards[:, 0] = torch.randint(0, 2, (8,), generator=gen).float()
    fn = core_algos.get_adv_estimator_fn("creditrl_otb")

    def call(m, old_log_probs=logp):
        return fn(token_level_rewards=rewards, response_mask=m, index=np.array([f"u{i // 4}" for i in range(8)],
                  dtype=object), config=None, old_log_probs=old_log_probs, sum_pi_squared=sum_p2)[0]
    if bad is None:
        torch.testing.assert_close(call(mask), call(mask != 0), rtol=0, atol=0)
        return
    bad_mask, bad_logp = mask.clone(), logp.clone()
    bad_mask[5, 3], bad_logp[2, 0] = bad, 0.5            # a bad mask and a log-prob above 0
    with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[5\]"):
        call(bad_mask, bad_logp)
    with pytest.raises(ValueError, match=r"old_log_probs: expected values <= 0"):
        call(mask, bad_logp)
    for wrong in (logp[:, :4], logp.long()):              # shape and dtype errors come after the mask's too
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[5\]"):
            call(bad_mask, wrong)
    with pytest.raises(ValueError, match=r"old_log_probs: expected a floating-point tensor, got dtype torch.int64"):
        call(mask, logp.long())


@settings(max_examples=120, deadline=None)
@given(rows=st.integers(0, 5), steps=st.sampled_from([0, 1, 7, 8, 16, 1016, 1024, 1032, 2048, 4104]),
       density=st.floats(0.0, 1.0), offset=st.sampled_from([0, 1, 8]), seed=st.integers(0, 999))
def test_bool_row_counts_match_a_loop(rows, steps, density, offset, seed):
    """SWAR counts of a bool mask made by torch's ops, any length (whole words or not, one chunk of
    128 words, several, a remainder), any density and storage offset, equal a loop's."""
    from creditrl.utils.validate import bool_row_counts
    gen = torch.Generator().manual_seed(seed)
    storage = torch.rand(rows * steps + offset, generator=gen) < density
    mask = storage[offset:].view(rows, steps)
    got = bool_row_counts(mask)
    assert got.dtype == torch.int64 and got.tolist() == [sum(row) for row in mask.tolist()]
