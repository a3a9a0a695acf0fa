// HOT's encoders of saved activations (compress_saved) on the primitives of cpu_primitives.cpp and
// the dtype dispatch of cpu_kernels.cpp, which precede this file in one translation unit; exported with
// C linkage for hot_compile/runtime/cpu_kernels.py.

namespace {

// The int8 levels of 16 values times `inverse` (1/s), rounded half to even, into out[0..16).
inline void levels_of_row(Float16x inverse, Int16x top, const Float16x& v16, int8_t* out) {
  Int16x l = nearest_levels(v16 * inverse, top);
  l = SELECT(l > -top, l, -top);
  const Int8x16 levels = convert<Int8x16>(l);
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

// The derivatives of GELU and of its tanh form in float64, as aten_impl.DERIVATIVES writes them.
double gelu_derivative(double x) {
  return 0.5 * std::erfc(-x / std::sqrt(2.0)) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}
double gelu_tanh_derivative(double x) {
  const double k = std::sqrt(2.0 / M_PI), t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

// Both derivatives are d(x) = f(|x|) for x ≥ 0 and 1 − f(|x|) below, and f is 1 past 6 (within
// 4·10⁻⁸). On [0, 6) f is a polynomial of degree 6 on each sixteenth, in s ∈ [−1, 1] across it,
// interpolating f in float64 at the Chebyshev nodes when the library first needs it (an error far
// under float32's roundings). A lane picks its sixteenth's coefficients with a permute: a few
// multiply-adds per value instead of an exponential and a rational function.
constexpr int PIECES = 16, DEGREE = 6;
constexpr float SATURATION = 6.0f;

struct Pieces {
  Float16x coefficient[DEGREE + 1];  // coefficient[k][i]: of s^k on sixteenth i

  explicit Pieces(double (*f)(double)) {
    constexpr int N = DEGREE + 1;
    float table[DEGREE + 1][PIECES];
    for (int i = 0; i < PIECES; ++i) {
      double a[N][N + 1];  // the Vandermonde system at the nodes, solved by Gauss-Jordan elimination
      for (int j = 0; j < N; ++j) {
        const double s = std::cos(M_PI * (2 * j + 1) / (2 * N));
        for (int k = 0; k < N; ++k) a[j][k] = std::pow(s, k);
        a[j][N] = f((i + 0.5 * (1.0 + s)) * SATURATION / PIECES);
      }
      for (int c = 0; c < N; ++c) {
        int pivot = c;
        for (int r = c + 1; r < N; ++r) pivot = std::fabs(a[r][c]) > std::fabs(a[pivot][c]) ? r : pivot;
        std::swap(a[c], a[pivot]);
        for (int r = 0; r < N; ++r) {
          const double m = r == c ? 0.0 : a[r][c] / a[c][c];
          for (int k = c; k <= N; ++k) a[r][k] -= m * a[c][k];
        }
      }
      for (int k = 0; k < N; ++k) table[k][i] = float(a[k][N] / a[k][k]);
    }
    for (int k = 0; k < N; ++k) coefficient[k] = load16(table[k]);
  }
};

inline Float16x symmetric_derivative16(const Pieces& pieces, Float16x x) {
  const Float16x u = magnitude(x), position = u * (PIECES / SATURATION);
  // Past the table (u ≥ 6, ∞, NaN) the lane's sixteenth is any: its value is replaced below.
  Int16x i = convert<Int16x>(position);
  i = SELECT(i < PIECES - 1, i, Int16x{} + (PIECES - 1));
  i = SELECT(i > 0, i, Int16x{});
  const Float16x s = 2.0f * (position - convert<Float16x>(i)) - 1.0f;
  // Each lane's coefficients, by a permute of the table.
  Float16x f = permute(pieces.coefficient[DEGREE], i);
  for (int k = DEGREE - 1; k >= 0; --k) f = f * s + permute(pieces.coefficient[k], i);
  f = SELECT(u < SATURATION, f, Float16x{} + 1.0f);
  const Float16x d = SELECT(x < 0.0f, 1.0f - f, f);
  return SELECT(x == x, d, x);  // a NaN stays NaN
}

const Pieces& pieces_of(int64_t function) {
  static const Pieces gelu(gelu_derivative), gelu_tanh(gelu_tanh_derivative);
  return function == GELU ? gelu : gelu_tanh;
}

// The derivative `function` of a row of `cols` values, into `out`.
template <typename T>
void derivative_row(int64_t function, const T* v, int64_t cols, float* out) {
  if (function != GELU && function != GELU_TANH) std::abort();  // cpu_kernels.py checks the name before it numbers it
  const Pieces& pieces = pieces_of(function);
  const int64_t whole = cols / 16 * 16;
  for (int64_t c = 0; c < whole; c += 16) {
    const Float16x f = symmetric_derivative16(pieces, load16(v + c));
    store16(f, out + c);
  }
  if (whole < cols) {
    const Float16x f = symmetric_derivative16(pieces, load16(v + whole, cols - whole));
    store_lanes(f, cols - whole, out + whole);
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
    Int16x l = convert<Int16x>((load16(v + c) - lo) * inverse + noise);  // floor: v ≥ lo
    l = SELECT(l < int32_t(TOP), l, Int16x{} + int32_t(TOP));
    l = SELECT(l > 0, l, Int16x{});
    const UInt8x16 bytes = convert<UInt8x16>(l);
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
