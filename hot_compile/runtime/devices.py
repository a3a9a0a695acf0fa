"""Device profiles for the cost model: rates and bandwidths as data.

A profile is a handful of throughputs. Built-in profiles cover the CPU kinds this project is measured
on and the common NVIDIA training GPUs (datasheet dense rates); ``hot-compile calibrate-device``
(:mod:`hot_compile.device_calibration`) measures the local machine and caches the result here, which
then takes precedence for that machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform

import torch

from .int8_gemm import u8s8_exact
from .quant import MAX_BITS, MIN_BITS, qmax

DTYPES = ("float32", "bfloat16", "float16")
# glibc's largest mmap threshold on 64-bit systems: a CPU buffer above it is a fresh mapping on every
# allocation, whose pages fault on first touch; below it, freed memory is reused from the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
# The CPU classes below this machine's whose code HOT can run here instead (env HOT_CPU_CLASS): GCC's
# -march for its build of the CPU library, the CPU flag that build needs, and the class's built-in
# profile. An AVX-512 machine so measures and tests the AVX2 class's code, its torch kernels kept to AVX2
# by their own settings (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA).
CPU_CLASSES = {"avx2": ("x86-64-v3", "avx2", "cpu-avx2-2core"), "x86-64": ("x86-64", "sse2", "cpu-generic")}


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Throughputs of one device.

    Attributes:
        name: profile name.
        matmul_flops: dense float matmul rate per dtype name, FLOP/s (2·M·N·K per product).
        int8_ops: rate of the integer product HOT runs on INT8 operands (``ops.int8_matmul``:
            ``torch._int_mm``, or a float GEMM on CPUs without VNNI/AMX), OP/s (2·M·N·K per product).
        read_bw: bytes/s streamed into an elementwise kernel.
        write_bw: bytes/s written to a newly allocated output of at most ``MMAP_THRESHOLD_BYTES``.
        fresh_write_bw: bytes/s written to a larger one, where the device pays for it apart (CPUs under
            glibc: a fresh mapping, each page faulting on first touch). None: ``write_bw``.
        transform_rate: outputs/s of a fused block-16 transform + stochastic int8 quantization kernel
            (16 multiply-adds, a hash and a rounding per output).
        kernel_overhead: seconds per kernel or extern call, whatever its size.
        op_overhead: seconds one of HOT's ops costs in a compiled step beyond its kernels' estimate:
            its dispatch, its calls into the kernels, and the cold caches it meets between the
            graph's other kernels (fitted on whole training steps of small layers).
        narrow_int8_ops: the rate on operands of at most 7 bits where it differs from ``int8_ops``: on
            x86 CPUs without VNNI/AMX, HOT's uint8 × int8 GEMM, whose int16 pair sums are exact there
            (:func:`~hot_compile.runtime.int8_gemm.u8s8_exact`). None: ``int8_ops``.
        fp32_attention_backward: the CPU's flash-attention backward runs faster in float32, with its
            operands upcast and its gradients cast back, than in bf16 (:mod:`~hot_compile.passes.attention_precision`).
        attention_backward_products: a half-precision attention backward without masks or dropout runs
            faster as products of its materialized scores (:mod:`~hot_compile.runtime.attention_ops`) than either fused
            kernel (:mod:`~hot_compile.passes.attention_precision`).
        int8_fused_epilogue: the integer product scales its int32 sums into the output as it goes, and
            writes no int32 product (HOT's own GEMM, :func:`~hot_compile.runtime.cpu_gemm.fused_gemm`);
            ``int8_ops`` is then that kernel's rate.
        stochastic_code_rate: values/s that a stochastic code of a saved value (the derivative code of
            :mod:`~hot_compile.passes.saved_activations`) rounds, beyond its reads and writes: a hash per
            two values and a rounding, no transform. None: ``transform_rate``, which prices a transform
            as well.
        attention_flops: FLOP/s of the fused attention kernels (``scaled_dot_product_attention``'s
            forward and backward, at :func:`~hot_compile.passes.cost_model.attention_flops`' counts) per
            dtype name, the faster direction's, so that an estimate at this rate stays a floor. A dtype
            it lacks: ``matmul_flops``, which no fused attention reaches on the CPUs measured.
    """

    name: str
    matmul_flops: dict[str, float]
    int8_ops: float
    read_bw: float
    write_bw: float
    transform_rate: float
    kernel_overhead: float
    op_overhead: float
    narrow_int8_ops: float | None = None
    fp32_attention_backward: bool = False
    attention_backward_products: bool = False
    fresh_write_bw: float | None = None
    int8_fused_epilogue: bool = False
    stochastic_code_rate: float | None = None
    attention_flops: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(DTYPES) - set(self.matmul_flops)
        if missing:
            raise ValueError(f"DeviceProfile {self.name!r}: matmul_flops lacks {sorted(missing)}")
        numbers = [*self.matmul_flops.values(), *self.attention_flops.values(), self.int8_ops, self.read_bw, self.write_bw, self.transform_rate]
        numbers += [v for v in (self.narrow_int8_ops, self.fresh_write_bw, self.stochastic_code_rate) if v is not None]
        if any(not (isinstance(v, (int, float)) and v > 0) for v in numbers) or min(self.kernel_overhead, self.op_overhead) < 0:
            raise ValueError(f"DeviceProfile {self.name!r}: rates must be positive numbers")
        object.__setattr__(self, "matmul_flops", dict(sorted(self.matmul_flops.items())))

    def matmul_rate(self, dtype: torch.dtype) -> float:
        return self.matmul_flops[str(dtype).removeprefix("torch.")]

    def attention_rate(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return self.attention_flops.get(name) or self.matmul_flops[name]

    def write_seconds(self, nbytes: float) -> float:
        """Seconds to write a new buffer of ``nbytes``: at ``fresh_write_bw`` above
        ``MMAP_THRESHOLD_BYTES`` where the profile has one, else at ``write_bw``."""
        large = self.fresh_write_bw is not None and nbytes > MMAP_THRESHOLD_BYTES
        return nbytes / (self.fresh_write_bw if large else self.write_bw)

    def stochastic_code_seconds(self, numel: int) -> float:
        """Seconds a stochastic code of a saved value spends rounding ``numel`` values, beyond its reads
        and writes: at ``stochastic_code_rate`` where the profile has one, else at ``transform_rate``."""
        return numel / (self.stochastic_code_rate or self.transform_rate)

    def int8_rate(self, bits: int) -> float:
        """OP/s of the integer product of two ``bits``-bit operands."""
        if self.narrow_int8_ops is not None and u8s8_exact(qmax(bits), qmax(bits)):
            return self.narrow_int8_ops
        return self.int8_ops

    def widest_bits_at_narrowest_rate(self) -> int:
        """The widest bit width whose integer product runs as fast as the narrowest's: 8 where the
        integer GEMM is int8 whatever the operands (GPUs, CPUs with VNNI or AMX), 7 where the fast path
        takes only narrow operands (HOT's uint8 × int8 GEMM on AVX2, exact while |b| ≤ 64)."""
        fastest = self.int8_rate(MIN_BITS)
        return max(b for b in range(MIN_BITS, MAX_BITS + 1) if self.int8_rate(b) >= fastest)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeviceProfile:
        return cls(**json.loads(text))


def _gpu(name, fp32, bf16, int8, bw, overhead=6e-6, op_overhead=3e-5):
    return DeviceProfile(
        name=name,
        matmul_flops={"float32": fp32, "bfloat16": bf16, "float16": bf16},
        int8_ops=int8,
        read_bw=bw,
        write_bw=bw,
        transform_rate=bw / 6,  # memory bound: ~6 bytes moved per output
        kernel_overhead=overhead,
        op_overhead=op_overhead,  # assumed: a Python dispatch and a few launches; not measured
    )


# CPU figures: 2 cores, torch 2.13.0, measured with `hot-compile calibrate-device` on the machine kinds
# named. GPU figures: dense datasheet rates (fp32 without TF32, as PyTorch's default matmul).
BUILTIN_PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            # AMX: bf16 products on AMX tiles (oneDNN), int8 ones on HOT's AMX kernel (torch._int_mm
            # runs on VNNI here, no faster than AMX bf16). This VM's AMX rates move 2-3x from one
            # second to the next; int8 ran at 2.3-2.4x a bf16 1024^3 product in interleaved runs.
            name="cpu-sapphire-rapids-2core",
            matmul_flops={"float32": 2.4e11, "bfloat16": 1.16e12, "float16": 2.6e11},
            int8_ops=2.7e12,
            int8_fused_epilogue=True,
            read_bw=4.6e10,
            write_bw=4.0e10,  # 32-47 GB/s into new 4 and 16 MiB buffers
            fresh_write_bw=3.7e9,  # 3.3-3.9 GB/s into new 38 and 77 MiB ones: a page fault per page
            transform_rate=1.76e9,
            stochastic_code_rate=6.1e9,  # the derivative code at [6272, 1536] bf16 (device_calibration.CODE_SHAPE)
            kernel_overhead=4.3e-6,
            op_overhead=1.5e-4,
            fp32_attention_backward=True,  # bf16 1.3x slower at ViT-S's attention shapes, 3-4x at MiniLM's
            # Not measured on this class: the native kernel runs on AVX512-BF16's pair products, which
            # it has, and took 0.38-0.46 of the float32 kernel's time at ViT-S's heads on Zen 4.
            attention_backward_products=True,
            # ViT-S's and MiniLM's heads: float32 103-109 GFLOP/s either way, bf16's forward 169-233
            # and its backward 23-80.
            attention_flops={"float32": 1.1e11, "bfloat16": 2.3e11},
        ),
        DeviceProfile(
            name="cpu-zen4-2core",  # no AMX: int8 on AVX512-VNNI, no native float16 matmul
            matmul_flops={"float32": 1.9e11, "bfloat16": 4.3e11, "float16": 1.0e9},
            int8_ops=7.6e11,
            read_bw=3.75e10,
            write_bw=2.4e10,
            transform_rate=2.7e9,  # fitted to the HQ op on its CPU kernels (device_calibration.FIT_SITES)
            kernel_overhead=6e-6,
            op_overhead=1e-4,  # fitted on training steps of small layers (device_calibration.OVERHEAD_LAYERS)
            fp32_attention_backward=True,  # bf16 1.3-1.8x slower at ViT-S's and MiniLM's attention shapes
            attention_backward_products=True,  # 0.70-0.94x the float32 kernel's time at ViT-S's and MiniLM's heads
            # int8_fused_epilogue stays off although HOT's VNNI GEMM fuses it here (cpu_gemm.fused_gemm):
            # priced so, the products would look cheaper and the tasks' decisions would change (MiniLM's
            # most of all), which their fidelity runs have not covered; the estimates stay pessimistic.
        ),
        DeviceProfile(
            # AMD EPYC, AVX2 only. The rates of HOT's own code on this class (its narrow GEMM, transforms and
            # codes) were measured as the class on Zen 4 (HOT_CPU_CLASS=avx2, torch's kernels kept to AVX2),
            # after that code changed: float32 came out there at 1.63e11, this class's own 1.6e11. INT8
            # products run on float32.
            name="cpu-avx2-2core",
            matmul_flops={"float32": 1.6e11, "bfloat16": 9.6e8, "float16": 8.8e8},
            int8_ops=1.3e11,
            read_bw=3.7e10,
            write_bw=3.0e10,
            transform_rate=1.6e9,
            stochastic_code_rate=6.0e9,
            kernel_overhead=4e-6,
            op_overhead=1e-4,  # not measured on this class: Zen 4's
            narrow_int8_ops=4.2e11,  # HOT's AVX2 GEMM on 7-bit operands
            fp32_attention_backward=True,  # not measured: bf16 matmuls run 170x slower than fp32 here
        ),
        DeviceProfile(
            name="cpu-generic",
            matmul_flops={"float32": 1.0e11, "bfloat16": 5.0e10, "float16": 5.0e10},
            int8_ops=1.0e11,
            read_bw=1.0e10,
            write_bw=3.0e9,
            transform_rate=5.0e8,
            kernel_overhead=2e-5,
            op_overhead=1e-4,
        ),
        _gpu("gpu-h200", fp32=67e12, bf16=989e12, int8=1979e12, bw=4.8e12),
        _gpu("gpu-h100", fp32=67e12, bf16=989e12, int8=1979e12, bw=3.35e12),
        _gpu("gpu-a100", fp32=19.5e12, bf16=312e12, int8=624e12, bw=2.0e12),
        _gpu("gpu-rtx3090", fp32=35.6e12, bf16=71e12, int8=284e12, bw=0.936e12),
        _gpu("gpu-generic", fp32=20e12, bf16=150e12, int8=300e12, bw=1.0e12),
    )
}

_GPU_NAMES = (("H200", "gpu-h200"), ("H100", "gpu-h100"), ("A100", "gpu-a100"), ("3090", "gpu-rtx3090"))


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_identity() -> str:
    """This machine as its calibration and its build of the CPU kernels know it: the CPU model, a digest
    of its feature flags (VMs of one model name differ in them), the core count and torch's version."""
    model, flags = platform.processor(), ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == platform.processor():
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = hashlib.sha256(value.strip().encode()).hexdigest()[:12]
    except OSError:
        pass
    return f"{model}|{flags}|{os.cpu_count()}cpu|torch-{torch.__version__}"


def runs_here(name: str) -> bool:
    """Whether this CPU can run the code of the CPU class ``name`` of :data:`CPU_CLASSES`."""
    return platform.machine() == "x86_64" and CPU_CLASSES[name][1] in _cpu_flags()


def cpu_class() -> str:
    """The CPU class HOT runs the code of: env ``HOT_CPU_CLASS`` (one of :data:`CPU_CLASSES`), else
    ``"native"``, this machine's own."""
    name = os.environ.get("HOT_CPU_CLASS") or "native"
    if name != "native" and name not in CPU_CLASSES:
        raise ValueError(f"HOT_CPU_CLASS={name!r}: HOT builds for {', '.join(CPU_CLASSES)} (or native)")
    if name != "native" and not runs_here(name):
        raise ValueError(f"HOT_CPU_CLASS={name!r}: this CPU has no {CPU_CLASSES[name][1]}, which that class's code needs")
    return name


def cache_root() -> pathlib.Path:
    """HOT's own cache folder on this machine, ``~/.cache/hot_compile`` (env ``HOT_CACHE_DIR`` moves it):
    what outlives Inductor's cache (the calibrated profile, the CPU kernels' library)."""
    return pathlib.Path(os.environ.get("HOT_CACHE_DIR") or pathlib.Path.home() / ".cache" / "hot_compile")


def cache_path() -> pathlib.Path:
    """Where the calibrated profile of this machine is cached."""
    return cache_root() / "device_profile.json"


def load_calibrated() -> DeviceProfile | None:
    """The cached calibration of this machine, or None (missing, unreadable, or another machine's)."""
    try:
        data = json.loads(cache_path().read_text())
        if data.pop("identity", None) != cpu_identity():
            return None
        return DeviceProfile(**data)
    except (OSError, ValueError, TypeError):
        return None


def resolve_profile(device: torch.device, name: str = "auto") -> DeviceProfile:
    """The profile to cost ``device`` with: ``name`` if given, else the built-in profile of the CPU class
    HOT runs (:func:`cpu_class`) where it is not this machine's, else this machine's calibration, else
    the built-in profile matching the CPU's features or the GPU's name, else a generic one."""
    if name != "auto":
        if name == "calibrated":
            profile = load_calibrated()
            if profile is None:
                raise ValueError("device_profile='calibrated' but no calibration cached: run `hot-compile calibrate-device`")
            return profile
        return BUILTIN_PROFILES[name]
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device) if torch.cuda.is_available() else ""
        return BUILTIN_PROFILES[next((p for key, p in _GPU_NAMES if key in gpu), "gpu-generic")]
    if cpu_class() != "native":
        return BUILTIN_PROFILES[CPU_CLASSES[cpu_class()][2]]
    calibrated = load_calibrated()
    if calibrated is not None:
        return calibrated
    flags = _cpu_flags()
    if "amx_int8" in flags:
        return BUILTIN_PROFILES["cpu-sapphire-rapids-2core"]
    if {"avx512_vnni", "avx512_bf16"} <= flags:
        return BUILTIN_PROFILES["cpu-zen4-2core"]
    if "avx2" in flags and "avx512_vnni" not in flags:
        return BUILTIN_PROFILES["cpu-avx2-2core"]
    return BUILTIN_PROFILES["cpu-generic"]


def save_calibrated(profile: DeviceProfile) -> pathlib.Path:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**dataclasses.asdict(profile), "identity": cpu_identity()}
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    return path
