"""Cost model, device profiles and policies."""

import dataclasses
import json

import pytest
import torch

import hot_compile
from hot_compile import HotConfig
from hot_compile.runtime import devices
from hot_compile.passes import cost_model
from hot_compile.passes.decide import decide
from tests.harness import aot_compile
from tests.models import MLP

CPU = devices.BUILTIN_PROFILES["cpu-sapphire-rapids-2core"]
H100 = devices.BUILTIN_PROFILES["gpu-h100"]


def _gx(l, n, k, profile=CPU, dtype=torch.float32, bits=4):
    return cost_model.grad_input_cost(l, n, k, dtype.itemsize, profile.matmul_rate(dtype), profile, bits)


def _gw(l, n, k, profile=CPU, rank=8, dtype=torch.float32, bits=8):
    return cost_model.grad_weight_cost(l, n, k, rank, dtype.itemsize, profile.matmul_rate(dtype), profile, bits)


@pytest.mark.parametrize("profile", devices.BUILTIN_PROFILES.values(), ids=lambda p: p.name)
def test_tiny_matmuls_are_slower_on_every_profile(profile):
    assert _gx(8, 8, 8, profile).speedup < 1
    assert _gw(8, 8, 8, profile).speedup < 1


def test_large_matmuls_are_faster_where_int8_outruns_the_float_rate():
    assert _gx(6272, 3072, 768).speedup > 1
    assert _gw(6272, 3072, 768).speedup > 1
    assert _gx(6272, 3072, 768, H100).speedup > 1


def test_speedup_grows_with_size_as_fixed_costs_amortize():
    # Up to 16 MiB outputs: above the mmap threshold both variants' fresh writes slow alike.
    ratios = [_gx(l, 1024, 1024).speedup for l in (16, 256, 1024, 4096)]
    assert ratios == sorted(ratios) and ratios[0] < 1 < ratios[-1]


@pytest.mark.parametrize("l", [16, 17, 197, 6272, 6304])
def test_saved_bytes_are_at_most_an_eighth_of_fp32_at_rank_8(l):
    cost = _gw(l, 64, 384)
    assert cost.saved_bytes_before == l * 384 * 4
    assert cost.saved_bytes_after == l // 2 * 384 + 4  # one row per pair of tokens, a 4-byte scale
    assert cost.saved_bytes_after - 4 <= cost.saved_bytes_before / 8


def _decide(path, shape, policy, **config):
    cost = _gx(*shape) if path == "gx" else _gw(*shape)
    return decide(path, shape[0] * shape[1] * shape[2], cost, HotConfig(policy=policy, **config))


def test_tiny_sites_kept_with_reason():
    for policy in ("speed", "balanced"):
        decision = _decide("gx", (8, 8, 8), policy)
        assert not decision.rewrite
        assert "M·N·K" in decision.reason and "slower" in decision.reason


def test_large_sites_rewritten_under_speed():
    decision = _decide("gx", (6272, 3072, 768), "speed")
    assert decision.rewrite and "faster" in decision.reason


def test_memory_compresses_where_speed_keeps():
    shape = (64, 64, 64)
    assert not _decide("gw", shape, "speed").rewrite
    memory = _decide("gw", shape, "memory")
    assert memory.rewrite and "ABC saves" in memory.reason
    assert not _decide("gx", shape, "memory").rewrite  # grad_input saves no memory


def test_balanced_bound():
    shape = (256, 256, 256)
    cost = _gx(*shape)
    slowdown = cost.hot_s / cost.original_s - 1
    assert _decide("gx", shape, "balanced", max_slowdown=slowdown + 0.01).rewrite
    assert not _decide("gx", shape, "balanced", max_slowdown=max(slowdown - 0.01, 0)).rewrite


def test_policies_on_a_graph_and_overrides_win():
    base = HotConfig(strict=True, device_profile="cpu-sapphire-rapids-2core")
    x = torch.randn(4, 50, 32, requires_grad=True)
    aot_compile(MLP(), base.replace(policy="speed"))[0](x).sum().backward()
    rows = hot_compile.last_report().products()
    assert len(rows) == 6 and all(r.decision == "kept" and "M·N·K" in r.reason for r in rows)
    assert all(r.est_original_ms > 0 and r.est_hot_ms > r.est_original_ms for r in rows)

    torch._dynamo.reset()
    aot_compile(MLP(), base.replace(policy="memory"))[0](x).sum().backward()
    assert {(r.path, r.decision) for r in hot_compile.last_report().products()} == {("fwd", "kept"), ("gx", "kept"), ("gw", "HLA+ABC")}

    torch._dynamo.reset()
    overridden = base.replace(policy="speed", overrides={"fc2": {"policy": "hot", "rank": 8}})
    aot_compile(MLP(), overridden)[0](x).sum().backward()
    fc2 = [r for r in hot_compile.last_report().products() if r.module == "fc2"]
    assert fc2 and all(r.decision != "kept" for r in fc2)
    fc1 = [r for r in hot_compile.last_report().products() if r.module == "fc1"]
    assert fc1 and all(r.decision == "kept" for r in fc1)


def test_profile_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("HOT_CACHE_DIR", str(tmp_path))
    assert devices.resolve_profile(torch.device("cpu"), "gpu-a100").name == "gpu-a100"
    auto = devices.resolve_profile(torch.device("cpu"))
    assert auto.name.startswith("cpu-")
    with pytest.raises(ValueError, match="calibrate-device"):
        devices.resolve_profile(torch.device("cpu"), "calibrated")
    measured = devices.DeviceProfile(**{**json.loads(CPU.to_json()), "name": "calibrated:test"})
    devices.save_calibrated(measured)
    assert devices.resolve_profile(torch.device("cpu")) == measured
    assert devices.resolve_profile(torch.device("cpu"), "calibrated") == measured


def test_profile_validation():
    with pytest.raises(ValueError, match="lacks"):
        devices.DeviceProfile("x", {"float32": 1.0}, 1, 1, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="positive"):
        devices.DeviceProfile("x", {"float32": 1, "bfloat16": 1, "float16": 0}, 1, 1, 1, 1, 0, 0)


def test_calibrate_device_cli(monkeypatch, tmp_path, capsys):
    from hot_compile import cli

    monkeypatch.setenv("HOT_CACHE_DIR", str(tmp_path))
    assert cli.main(["calibrate-device", "--size", "64", "--repeats", "1"]) == 0
    profile = devices.load_calibrated()
    assert profile is not None and profile.int8_ops > 0 and profile.stochastic_code_rate > 0
    assert set(profile.attention_flops) == {"float32", "bfloat16"}
    assert devices.resolve_profile(torch.device("cpu")) == profile
    assert "saved to" in capsys.readouterr().out


def test_narrow_operands_are_priced_at_their_own_rate_where_a_profile_has_one():
    """On x86 CPUs without VNNI, INT4..INT7 products run on oneDNN's uint8 × int8 GEMM and INT8 ones
    on a float GEMM: the profile's two rates, by bit width."""
    avx2 = devices.BUILTIN_PROFILES["cpu-avx2-2core"]
    assert [avx2.int8_rate(bits) for bits in (4, 7, 8)] == [avx2.narrow_int8_ops] * 2 + [avx2.int8_ops]
    assert _gx(6272, 768, 3072, avx2, bits=4).hot_s < _gx(6272, 768, 3072, avx2, bits=8).hot_s
    assert CPU.narrow_int8_ops is None and CPU.int8_rate(4) == CPU.int8_rate(8) == CPU.int8_ops


@pytest.mark.parametrize(
    "profile,bits",
    [("cpu-avx2-2core", 7), ("cpu-sapphire-rapids-2core", 8), ("gpu-h100", 8)],
)
def test_auto_bits_are_the_widest_at_the_narrowest_rate(profile, bits):
    """INT4 has no GEMM of its own on these devices: its operands run through the int8 kernels, so the
    default takes the widest width that costs the same. On AVX2 the exact uint8 × int8 GEMM stops at
    7 bits (two ±63 operands: 2·126·63 ≤ 32767)."""
    from hot_compile.passes.numerics import resolve_numerics

    resolved = devices.BUILTIN_PROFILES[profile]
    assert resolved.widest_bits_at_narrowest_rate() == bits
    defaults = resolve_numerics(HotConfig(), resolved)
    assert (defaults.gx_bits, defaults.gw_bits, defaults.forward_bits) == (bits, bits, bits)
    chosen = resolve_numerics(HotConfig(gx_bits=4, gw_bits=6, forward_bits=None), resolved)
    assert (chosen.gx_bits, chosen.gw_bits, chosen.forward_bits) == (4, 6, None)


def test_each_hot_op_pays_the_op_overhead():
    """HQ and the integer forward are one op each; HLA+ABC two (its backward op and the forward's
    compression). The original products pay none of it."""
    free = dataclasses.replace(CPU, op_overhead=0.0)
    shape = (512, 64, 64)
    assert _gx(*shape).hot_s - _gx(*shape, free).hot_s == pytest.approx(CPU.op_overhead)
    assert _gw(*shape).hot_s - _gw(*shape, free).hot_s == pytest.approx(2 * CPU.op_overhead)
    assert _gx(*shape).original_s == _gx(*shape, free).original_s


def test_a_derivative_code_writes_the_derivative_and_no_decoded_value():
    """A derivative code costs the forward one more buffer than a row code of a value the forward
    writes anyway, the derivative itself at ``c`` bytes a value, which the encoder then reads and
    rounds stochastically at the profile's stochastic code rate; the backward decodes it inside the
    multiply that reads it, where a row code's decoded value is written (``numel·b`` bytes)."""
    numel, rows, elem_bytes, computed_bytes = 6272 * 3072, 6272, 4, 2
    row_code = cost_model.saved_compression_cost(numel, rows, elem_bytes, 4, 2, CPU)
    derivative = cost_model.saved_compression_cost(numel, rows, elem_bytes, 4, 2, CPU, derivative_bytes=computed_bytes)
    written = CPU.write_seconds(numel * computed_bytes) - CPU.write_seconds(numel * elem_bytes)
    range_read = numel * (computed_bytes - elem_bytes) / CPU.read_bw
    rounding = CPU.stochastic_code_seconds(numel) - numel * elem_bytes / CPU.read_bw
    assert derivative.hot_s - row_code.hot_s == pytest.approx(written + range_read + rounding)
    assert derivative.saved_bytes_after == row_code.saved_bytes_after


def test_a_derivative_the_encoder_computes_writes_no_buffer_and_reads_the_input():
    """Where the encoder computes the derivative from ``x`` (``c = 0``), the forward writes no
    derivative buffer (above the mmap threshold here, at the fresh-page rate), and the encoder reads
    ``x`` at its own ``b`` bytes a value in place of the buffer's ``c``."""
    numel, rows, elem_bytes = 6272 * 3072, 6272, 4
    written = cost_model.saved_compression_cost(numel, rows, elem_bytes, 4, 2, CPU, derivative_bytes=2)
    computed = cost_model.saved_compression_cost(numel, rows, elem_bytes, 4, 2, CPU, derivative_bytes=0)
    buffer = CPU.write_seconds(numel * 2)
    assert buffer == pytest.approx(numel * 2 / CPU.fresh_write_bw)
    assert written.hot_s - computed.hot_s == pytest.approx(buffer - numel * (elem_bytes - 2) / CPU.read_bw)
    assert computed.saved_bytes_after == written.saved_bytes_after and computed.original_s == 0.0


def test_a_stochastic_code_rounds_at_its_own_rate_where_the_profile_has_one():
    """The derivative code has no transform: a profile that measured its rate prices it at that rate,
    one that did not at the transform rate (an upper bound: the transform's multiply-adds on top)."""
    numel = 6272 * 3072
    measured = dataclasses.replace(CPU, transform_rate=1e9, stochastic_code_rate=4e9)
    assert measured.stochastic_code_seconds(numel) == pytest.approx(numel / 4e9)
    assert dataclasses.replace(measured, stochastic_code_rate=None).stochastic_code_seconds(numel) == pytest.approx(numel / 1e9)
    cost = lambda profile: cost_model.saved_compression_cost(numel, 6272, 4, 4, 2, profile, derivative_bytes=2).hot_s
    assert cost(dataclasses.replace(measured, stochastic_code_rate=None)) - cost(measured) == pytest.approx(numel / 1e9 - numel / 4e9)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(CPU, stochastic_code_rate=0.0)


def test_a_buffer_above_the_mmap_threshold_is_written_at_the_fresh_rate():
    """Above glibc's largest mmap threshold every page of a new buffer faults; below it the heap reuses
    memory. A profile without a fresh rate writes both at ``write_bw``."""
    limit = devices.MMAP_THRESHOLD_BYTES
    assert CPU.fresh_write_bw < CPU.write_bw
    assert CPU.write_seconds(limit) == pytest.approx(limit / CPU.write_bw)
    assert CPU.write_seconds(limit + 1) == pytest.approx((limit + 1) / CPU.fresh_write_bw)
    flat = dataclasses.replace(CPU, fresh_write_bw=None)
    assert flat.write_seconds(2 * limit) == pytest.approx(2 * limit / CPU.write_bw)
    with pytest.raises(ValueError, match="rates must be positive"):
        dataclasses.replace(CPU, fresh_write_bw=0.0)


def test_a_fused_epilogue_writes_no_int32_product():
    """Where the integer product dequantizes as it goes (HOT's AMX kernel) the int32 product's write
    and read, and the dequantize's call, leave the estimate; the output's write stays."""
    m, k, n = 6272, 768, 3072
    fused = dataclasses.replace(CPU, int8_fused_epilogue=True)
    chunked = dataclasses.replace(CPU, int8_fused_epilogue=False)
    int32 = m * n * 4 / CPU.write_bw + m * n * 4 / CPU.read_bw + CPU.kernel_overhead
    fused_s, chunked_s = (cost_model.int_matmul_time(m, k, n, 2, p, 8) for p in (fused, chunked))
    assert chunked_s - fused_s == pytest.approx(int32)
    assert fused_s == pytest.approx(2 * m * k * n / CPU.int8_ops + CPU.write_seconds(m * n * 2) + CPU.kernel_overhead)


def test_op_overhead_is_the_least_squares_fit_of_step_residuals(monkeypatch):
    """With measured steps that exceed the estimates at o = 0 by 4·o₀ per layer (4 ops: the forward,
    HQ, HLA and the compression), the fit returns o₀."""
    from hot_compile import device_calibration

    o = 1.5e-4
    profile = devices.BUILTIN_PROFILES["cpu-zen4-2core"]

    def steps(l, n, k, repeats):
        sites = device_calibration.layer_site_costs(l, n, k, dataclasses.replace(profile, op_overhead=0.0))
        assert set(sites) == {"fwd", "gx", "gw"}
        return 1.0, 1.0 + sum(c.hot_s - c.original_s for c in sites.values()) + 4 * o

    monkeypatch.setattr(device_calibration, "layer_step_seconds", steps)
    assert device_calibration._fitted_op_overhead(profile, repeats=1) == pytest.approx(o)


@pytest.mark.parametrize("shape", [(2, 6, 197, 197, 64, 64), (3, 4, 128, 96, 32, 48)])
def test_attention_flops_count_as_torch_flop_counter_does(shape):
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    b, h, l, s, e, ev = shape
    q, k, v, out = (b, h, l, e), (b, h, s, e), (b, h, s, ev), (b, h, l, ev)
    assert cost_model.attention_flops(*shape, backward=False, causal=False) == sdpa_flop_count(q, k, v)
    assert cost_model.attention_flops(*shape, backward=True, causal=False) == sdpa_backward_flop_count(out, q, k, v)
    assert cost_model.attention_flops(*shape, backward=True, causal=True) == sdpa_backward_flop_count(out, q, k, v) // 2


def test_attention_is_priced_at_its_own_rate_where_the_profile_has_one():
    """The fused attention kernels run far below the matmul rate on the CPUs measured; a dtype the
    profile did not measure falls back to the matmul rate, so an estimate from it stays a floor."""
    assert CPU.attention_rate(torch.float32) == CPU.attention_flops["float32"] < CPU.matmul_rate(torch.float32)
    assert CPU.attention_rate(torch.float16) == CPU.matmul_rate(torch.float16)
    assert H100.attention_rate(torch.bfloat16) == H100.matmul_rate(torch.bfloat16)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(CPU, attention_flops={"float32": 0.0})


def test_a_saved_value_is_written_once_and_read_once():
    nbytes = 3 * devices.MMAP_THRESHOLD_BYTES
    assert cost_model.saved_traffic_time(nbytes, CPU) == pytest.approx(nbytes / CPU.fresh_write_bw + nbytes / CPU.read_bw)
