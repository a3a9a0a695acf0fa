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

// aten_impl.encode_derivative: each row's values as 4-bit codes q over [lo, lo + 15·step], with
// step = (max − min) / 14 (a zero step becomes 1) and lo = step·⌊min / step⌋, q = ⌊(v − lo)·(1/step) + u⌋
// at most 15 (u: the hash noise of the value's flat index), two codes a byte as quant.pack_nibbles
// packs them: element i in the low nibble of byte i, element cols/2 + i in the high one.
template <typename T>
void derivative_encode(const T* x, int64_t rows, int64_t cols, uint32_t offset, uint8_t* packed, float* lo_out,
                       float* step_out) {
  constexpr float TOP = 15.0f;
  const int64_t half = cols / 2;
#pragma omp parallel
  {
    std::vector<uint8_t> codes(cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* v = x + r * cols;
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
        std::memcpy(codes.data() + c, &bytes, sizeof bytes);
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
  }
}

}  // namespace

extern "C" {

void hot_rows_encode(const void* x, int64_t dtype, const int64_t* size, const int64_t* stride, const int64_t* row,
                     int64_t cols, int64_t qmax, int8_t* q, float* scale) {
  by_dtype(dtype, x, [&](auto* t) { rows_encode(t, size, stride, row, cols, float(qmax), q, scale); });
}

void hot_derivative_encode(const void* x, int64_t dtype, int64_t rows, int64_t cols, uint32_t offset, uint8_t* packed,
                           float* lo, float* step) {
  by_dtype(dtype, x, [&](auto* t) { derivative_encode(t, rows, cols, offset, packed, lo, step); });
}

}  // extern "C"
