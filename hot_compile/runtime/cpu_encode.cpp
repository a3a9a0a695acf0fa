// HOT's encoders of saved activations (compress_saved) on the primitives of cpu_primitives.cpp and
// the dtype dispatch of cpu_kernels.cpp, which precede this file in one translation unit; exported with
// C linkage for hot_compile/runtime/cpu_kernels.py.

namespace {

// The int8 levels of 16 values times `inverse` (1/s), rounded half to even, into out[0..16).
inline void levels_of_row(Float16x inverse, Int16x top, const Float16x& v16, int8_t* out) {
  Int16x l = nearest_levels(v16 * inverse, top);
  l = l > -top ? l : -top;
  const Int8x16 levels = __builtin_convertvector(l, Int8x16);
  std::memcpy(out, &levels, 16);
}

// aten_impl.encode_rows: each row of `cols` contiguous values v as int8 levels v·(1/s), s = max|row| / qmax
// (a zero scale becomes 1), rounded half to even; one read of the row for its maximum, one for its
// levels. Rows are indexed by three leading dimensions, visited in memory order: `size[d]` rows
// `stride[d]` values apart in x, whose codes are `row[d]` rows apart in q (a head's query in a fused
// qkv output, [batch, heads, tokens], is read in place, a token's heads one after the other).
template <typename T>
void rows_encode(const T* x, const int64_t* size, const int64_t* stride, const int64_t* row, int64_t cols, float qmax,
                 int8_t* q, float* scale) {
  const Int16x top = Int16x{} + int32_t(qmax);
  const int64_t whole = cols / 16 * 16;
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t a = 0; a < size[0]; ++a) {
    for (int64_t b = 0; b < size[1]; ++b) {
      for (int64_t c = 0; c < size[2]; ++c) {
        const T* v = x + a * stride[0] + b * stride[1] + c * stride[2];
        const int64_t r = a * row[0] + b * row[1] + c * row[2];
        Float16x m = {};
        for (int64_t k = 0; k < whole; k += 16) m = max_magnitude(m, load16(v + k));
        if (whole < cols) m = max_magnitude(m, load16(v + whole, cols - whole));
        const float s = scale_of(lanes_max(m), qmax);
        scale[r] = s;
        // Times 1/s, as the reference (quant.quantize_nearest): a division per vector took a third of the time.
        const Float16x inverse = Float16x{} + 1.0f / s;
        int8_t* out = q + r * cols;
        for (int64_t k = 0; k < whole; k += 16) levels_of_row(inverse, top, load16(v + k), out + k);
        if (whole < cols) {
          int8_t tail[16];
          levels_of_row(inverse, top, load16(v + whole, cols - whole), tail);
          std::memcpy(out + whole, tail, cols - whole);
        }
      }
    }
  }
}

// The derivatives the encoder computes from x itself, as hot_compile/runtime/cpu_kernels.py numbers
// them (aten_impl.DERIVATIVES): GIVEN codes x as it is.
enum : int64_t { GIVEN = 0, GELU = 1, GELU_TANH = 2 };

// e^x lane-wise: x = n·ln 2 + r (|r| ≤ ln 2 / 2, ln 2 in two parts), e^r by its degree-6 Taylor
// polynomial, 2^n by the exponent bits; within 2⁻²² of e^x. Below −87 (e^x < 1.7·10⁻³⁸, under the
// smallest normal float times 1.4) it is 0, so that a term x·e^x vanishes for every finite x; above 88
// it stays e^88. A NaN stays NaN.
inline Float16x exp16(Float16x x) {
  const Int16x underflow = x < -87.0f;
  const Float16x y = x > 88.0f ? 88.0f : (underflow ? -87.0f : x);
  const Int16x n = __builtin_convertvector(y * 1.44269504f + (y < 0.0f ? -0.5f : 0.5f), Int16x);  // nearest
  const Float16x nf = __builtin_convertvector(n, Float16x);
  const Float16x r = (y - nf * 0.693359375f) + nf * 2.12194440e-4f;  // Cody and Waite's split of ln 2
  Float16x p = Float16x{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // Unsigned: a NaN's n is INT_MIN, whose signed shift would be undefined; its p is NaN anyway.
  const Float16x e = p * (Float16x)(((UInt16x)(n + 127)) << 23);
  return underflow ? 0.0f : e;
}

// Lane-wise derivatives, in float32, as aten_impl.DERIVATIVES writes them; each within 3·10⁻⁷ of its
// exact value (tests/tolerances.py: DERIVATIVE_EVALUATION), saturating to 0 and 1 for any finite x.
// GELU: Φ(x) + x·φ(x). Φ by Abramowitz and Stegun's 7.1.26 (|error| ≤ 1.5·10⁻⁷ in erf), whose
// e^(−x²/2) φ shares.
inline Float16x gelu_derivative16(Float16x x) {
  const Float16x z = magnitude(x) * 0.707106781f, e = exp16(-0.5f * x * x);
  const Float16x t = 1.0f / (1.0f + 0.3275911f * z);
  Float16x p = Float16x{} + 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const Float16x tail = 0.5f * p * t * e;  // Φ(−|x|)
  return (x < 0.0f ? tail : 1.0f - tail) + x * e * 0.398942280f;
}
// GELU with tanh: ½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715x²), t = tanh(u), u = √(2/π)(x + 0.044715x³).
// From e = e^(−2|u|): |t| = (1 − e)/(1 + e) and 1 − t² = 4e/(1 + e)², which keep their digits where
// |t| nears 1 (1 − t·t would cancel them).
inline Float16x gelu_tanh_derivative16(Float16x x) {
  const Float16x x2 = x * x, u = 0.797884561f * x * (1.0f + 0.044715f * x2);
  const Float16x e = exp16(-2.0f * magnitude(u)), s = 1.0f + e;
  const Float16x size = (1.0f - e) / s, t = u < 0.0f ? -size : size;
  const Float16x slope = 0.5f * x * (4.0f * e / (s * s)) * 0.797884561f * (1.0f + 0.134145f * x2);
  return 0.5f * (1.0f + t) + (e > 0.0f ? slope : 0.0f);  // where x² overflows, 0 · ∞ would be NaN
}
// The derivative `function` of a row of `cols` values, into `out`.
template <typename T>
void derivative_row(int64_t function, const T* v, int64_t cols, float* out) {
  auto each = [&](auto derivative) {
    const int64_t whole = cols / 16 * 16;
    for (int64_t c = 0; c < whole; c += 16) {
      const Float16x f = derivative(load16(v + c));
      std::memcpy(out + c, &f, sizeof f);
    }
    if (whole < cols) {
      const Float16x f = derivative(load16(v + whole, cols - whole));
      std::memcpy(out + whole, &f, (cols - whole) * sizeof(float));
    }
  };
  switch (function) {
    case GELU: return each(gelu_derivative16);
    case GELU_TANH: return each(gelu_tanh_derivative16);
    default: std::abort();  // cpu_kernels.py checks the name before it numbers it
  }
}

// aten_impl.encode_derivative: each row's values as 4-bit codes q over [lo, lo + 15·step], with
// step = (max − min) / 14 (a zero step becomes 1) and lo = step·⌊min / step⌋, q = ⌊(v − lo)·(1/step) + u⌋
// at most 15 (u: the hash noise of the value's flat index), two codes a byte as quant.pack_nibbles
// packs them: element i in the low nibble of byte i, element cols/2 + i in the high one. The values v
// are x, or the derivative `function` of x, computed a row at a time (no derivative buffer: one the
// forward wrote would be written, faulted in and read again).
template <typename T>
void code_row(const T* v, int64_t r, int64_t cols, uint32_t offset, uint8_t* codes, uint8_t* packed, float* lo_out,
              float* step_out) {
  constexpr float TOP = 15.0f;
  const int64_t half = cols / 2;
  float least = INFINITY, most = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(min : least) reduction(max : most) reduction(| : nan)
  for (int64_t c = 0; c < cols; ++c) {
    const float f = to_float(v[c]);
    least = f < least ? f : least;
    most = f > most ? f : most;
    nan |= f != f;
  }
  float step = nan ? std::nanf("") : (most - least) / (TOP - 1.0f);
  step = step == 0.0f ? 1.0f : step;
  const float lo = std::floor(least / step) * step, inverse = 1.0f / step;
  lo_out[r] = lo;
  step_out[r] = step;
  auto vector = [&](int64_t c, Float16x noise) {
    Int16x l = __builtin_convertvector((load16(v + c) - lo) * inverse + noise, Int16x);  // floor: v ≥ lo
    l = l < int32_t(TOP) ? l : int32_t(TOP);
    l = l > 0 ? l : 0;
    const UInt8x16 bytes = __builtin_convertvector(l, UInt8x16);
    std::memcpy(codes + c, &bytes, sizeof bytes);
  };
  auto scalar = [&](int64_t c, float noise) {
    const float l = std::floor((to_float(v[c]) - lo) * inverse + noise);
    codes[c] = uint8_t(l > 0.0f ? (l < TOP ? l : TOP) : 0.0f);  // a NaN gives 0, as the vector lanes do
  };
  with_noise(cols, uint32_t(r * cols), offset, vector, scalar);
  uint8_t* out = packed + r * half;
#pragma omp simd
  for (int64_t c = 0; c < half; ++c) out[c] = uint8_t(codes[c] | (codes[half + c] << 4));
}

template <typename T>
void derivative_encode(const T* x, int64_t function, int64_t rows, int64_t cols, uint32_t offset, uint8_t* packed,
                       float* lo, float* step) {
#pragma omp parallel
  {
    std::vector<uint8_t> codes(cols);
    std::vector<float> values(function == GIVEN ? 0 : cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      if (function == GIVEN) {
        code_row(x + r * cols, r, cols, offset, codes.data(), packed, lo, step);
      } else {
        derivative_row(function, x + r * cols, cols, values.data());
        code_row(values.data(), r, cols, offset, codes.data(), packed, lo, step);
      }
    }
  }
}

}  // namespace

extern "C" {

void hot_rows_encode(const void* x, int64_t dtype, const int64_t* size, const int64_t* stride, const int64_t* row,
                     int64_t cols, int64_t qmax, int8_t* q, float* scale) {
  by_dtype(dtype, x, [&](auto* t) { rows_encode(t, size, stride, row, cols, float(qmax), q, scale); });
}

void hot_derivative_values(const void* x, int64_t dtype, int64_t function, int64_t count, float* out) {
  constexpr int64_t SPAN = 4096;
  by_dtype(dtype, x, [&](auto* t) {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < count; c += SPAN) derivative_row(function, t + c, std::min(SPAN, count - c), out + c);
  });
}

void hot_derivative_encode(const void* x, int64_t dtype, int64_t function, int64_t rows, int64_t cols, uint32_t offset,
                           uint8_t* packed, float* lo, float* step) {
  by_dtype(dtype, x, [&](auto* t) { derivative_encode(t, function, rows, cols, offset, packed, lo, step); });
}

}  // extern "C"
