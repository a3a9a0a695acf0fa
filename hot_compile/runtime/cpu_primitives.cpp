// HOT's transforms and quantizers for CPUs, fused so that each reads its operand once per pass: the
// primitives (element types, the hash, rounding, the 16-point Hadamard transform), on the vectors of
// cpu_vectors.cpp, which precedes this file in one translation unit; cpu_kernels.cpp follows it.
//
// Built at first use by Inductor's C++ toolchain (the flags and vector ISA of its own CPU kernels)
// and cached on disk with its kernels; called through ctypes from hot_compile/runtime/cpu_kernels.py,
// which documents each function. The arithmetic is that of hot_compile/runtime/aten_impl.py: the same block
// transforms, scales, hash noise (hot_compile/runtime/quant.py) and rounding; only the order of float
// additions inside a transform differs.

// Inductor's flags turn the loop vectorizer off (its kernels vectorize by hand); these loops rely on it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("tree-loop-vectorize")
#endif

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 16;
// Columns per tile of the column transforms: four AVX-512 registers per transformed row.
constexpr int64_t TILE = 64;

// Element types, as hot_compile/runtime/cpu_kernels.py numbers them.
enum : int64_t { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };

struct BFloat16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(BFloat16 v) {
  uint32_t word = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}
inline float to_float(_Float16 v) { return float(v); }

// The bf16 bits of float32 bits `word` (a uint32_t, or UInt16x for 16 lanes): rounded to nearest even,
// a NaN kept a quiet NaN.
template <typename Word>
inline Word bfloat16_bits(Word word) {
  return SELECT((word & 0x7fffffffu) > 0x7f800000u, (word >> 16) | 0x40u, (word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

inline void store(float v, float* out) { *out = v; }
inline void store(float v, BFloat16* out) {
  uint32_t word;
  std::memcpy(&word, &v, sizeof word);
  out->bits = uint16_t(bfloat16_bits(word));
}
inline void store(float v, _Float16* out) { *out = _Float16(v); }

// 16 consecutive values as float lanes.
inline Float16x load16(const float* x) { return vector_load<Float16x>(x); }
inline Float16x load16(const BFloat16* x) {
#if defined(__AVX512F__)
  // One widening load: GCC lowers the generic conversion below to two 256-bit halves and an insert.
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return (Float16x)_mm512_slli_epi32(words, 16);
#else
  UInt16x16 bits;
  std::memcpy(&bits, x, sizeof bits);
  return bitcast<Float16x>(convert<UInt16x>(bits) << 16);
#endif
}
inline Float16x load16(const _Float16* x) {
  Half16x v;
  std::memcpy(&v, x, sizeof v);
  return convert<Float16x>(v);
}
// The first `count` ≤ 16 values `stride` apart, zero beyond.
template <typename T>
inline Float16x load16(const T* x, int64_t count, int64_t stride = 1) {
  T padded[16] = {};
  for (int64_t i = 0; i < count; ++i) padded[i] = x[i * stride];
  return load16(padded);
}

// 16 lanes stored as store() stores each.
inline void store16(Float16x v, float* out) { vector_store(v, out); }
inline void store16(Float16x v, BFloat16* out) {
  const UInt16x16 bits = convert<UInt16x16>(bfloat16_bits(bitcast<UInt16x>(v)));
  std::memcpy(out, &bits, sizeof bits);
}
inline void store16(Float16x v, _Float16* out) {
  const Half16x halves = convert<Half16x>(v);
  std::memcpy(out, &halves, sizeof halves);
}

// The first `count` lanes of v (all 16 from 16 on), as store() stores each.
template <typename Out>
inline void store_lanes(Float16x v, int64_t count, Out* out) {
  if (count >= 16) {
    store16(v, out);
  } else {
    for (int64_t j = 0; j < count; ++j) store(v[j], out + j);
  }
}

// |v| lane-wise, by the sign bit.
inline Float16x magnitude(Float16x v) { return bitcast<Float16x>(bitcast<Int16x>(v) & 0x7fffffff); }

// hot_compile/runtime/quant.py's hash_uniform: the noise of flat index `index` under `offset`
// (seed·SEED_MULT + salt·SALT_MULT, mod 2**32). The values 32a + c and 32a + 16 + c (c < 16) share the
// word 16a + c: the low and the high 16 bits of its hash.
template <typename Word>  // uint32_t, or UInt16x for 16 lanes at once
inline Word mix32(Word h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  return h ^ (h >> 16);
}
constexpr uint32_t INDEX_MULT = 0x85EBCA6Bu;
inline float hash_uniform(uint32_t index, uint32_t offset) {
  const uint32_t word = ((index >> 1) & ~15u) | (index & 15u);
  return float((mix32(word * INDEX_MULT + offset) >> (index & 16u)) & 0xffffu) * (1.0f / 65536.0f);
}
// The noise of the 32 values from index `first` (a multiple of 32): the first 16 from the low halves
// of 16 hashes, the next 16 from their high halves, so that one hash serves two values.
struct Uniform32 {
  Float16x low, high;
};
inline Uniform32 uniform32(uint32_t first, uint32_t offset) {
  const UInt16x lanes = UInt16x{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * INDEX_MULT;
  const UInt16x h = mix32(lanes + ((first >> 1) * INDEX_MULT + offset));
  // 16-bit halves convert exactly through int32, which has a vector instruction on AVX2 too.
  return {convert<Float16x>(bitcast<Int16x>(h & 0xffffu)) * (1.0f / 65536.0f),
          convert<Float16x>(bitcast<Int16x>(h >> 16)) * (1.0f / 65536.0f)};
}
// Visits `count` values whose noise indices run from `first`: `vector(c, u)` for the 16 values from c
// with their noise, `scalar(c, u)` for one value. Where the indices run through a whole multiple of 32,
// one hash gives the noise of two values (uniform32); the values before and after it go one by one.
template <typename Vector, typename Scalar>
inline void with_noise(int64_t count, uint32_t first, uint32_t offset, Vector&& vector, Scalar&& scalar) {
  const int64_t lead = std::min<int64_t>(count, (32u - (first & 31u)) & 31u);
  int64_t c = 0;
  for (; c < lead; ++c) scalar(c, hash_uniform(first + uint32_t(c), offset));
  for (; c + 32 <= count; c += 32) {
    const Uniform32 u = uniform32(first + uint32_t(c), offset);
    vector(c, u.low);
    vector(c + 16, u.high);
  }
  for (; c < count; ++c) scalar(c, hash_uniform(first + uint32_t(c), offset));
}

// A NaN wins, so that a NaN or Inf input leaves a non-finite scale.
inline float max_magnitude(float m, float v) {
  float a = std::fabs(v);
  return (a > m || a != a) ? a : m;
}

// One level: stochastic, sign(v)·floor(|v|/s + u); else round half to even, as torch.round.
// `inverse` is 1/s, `noise` is u.
template <bool Stochastic>
inline int8_t level(float v, float inverse, float qmax, float noise) {
  float l;
  if constexpr (Stochastic) {
    l = std::floor(std::fabs(v) * inverse + noise);
    l = v < 0 ? -l : l;
  } else {
    l = std::nearbyint(v * inverse);
  }
  l = l < qmax ? l : qmax;  // a NaN level (non-finite scale) lands here: its product is NaN anyway
  l = l > -qmax ? l : -qmax;
  return int8_t(int32_t(l));
}

// y rounded half to even (as torch.round, for |y| below 2^22), at most `top`.
inline Int16x nearest_levels(Float16x y, Int16x top) {
  // Adding and subtracting 1.5·2^23 rounds a float below 2^22 in magnitude half to even.
  const float round_even = 12582912.0f;
  const Int16x l = convert<Int16x>((y + round_even) - round_even);
  return SELECT(l < top, l, top);
}

// Quantizes `count` values with `level`: 1/s per value (PerValue) or one for all; noise indices run
// from `first`. 16 lanes at a time: the compiler leaves the hash's integer words to scalar code otherwise.
template <bool Stochastic, bool PerValue>
inline void quantize_span(const float* v, const float* inverse, int64_t count, float qmax, uint32_t first,
                          uint32_t offset, int8_t* out) {
  const Int16x top = Int16x{} + int32_t(qmax), bottom = -top;
  auto vector = [&](int64_t c, Float16x noise) {
    const Float16x x = load16(v + c), inv = PerValue ? load16(inverse + c) : Float16x{} + inverse[0];
    Int16x l;
    if constexpr (Stochastic) {
      l = convert<Int16x>(magnitude(x) * inv + noise);  // floor, as |x|/s + u ≥ 0 (a NaN gives some int: see level)
      l = SELECT(l < top, l, top);
      l = SELECT(x < 0, -l, l);
    } else {
      l = nearest_levels(x * inv, top);
    }
    l = SELECT(l > bottom, l, bottom);
    const Int8x16 q = convert<Int8x16>(l);
    std::memcpy(out + c, &q, sizeof q);
  };
  auto scalar = [&](int64_t c, float noise) { out[c] = level<Stochastic>(v[c], PerValue ? inverse[c] : inverse[0], qmax, noise); };
  if constexpr (Stochastic) {
    with_noise(count, first, offset, vector, scalar);
  } else {
    int64_t c = 0;
    for (; c + 16 <= count; c += 16) vector(c, Float16x{});
    for (; c < count; ++c) scalar(c, 0.0f);
  }
}

template <bool PerValue>
inline void quantize_span(bool stochastic, const float* v, const float* inverse, int64_t count, float qmax,
                          uint32_t first, uint32_t offset, int8_t* out) {
  if (stochastic) {
    quantize_span<true, PerValue>(v, inverse, count, qmax, first, offset, out);
  } else {
    quantize_span<false, PerValue>(v, inverse, count, qmax, first, offset, out);
  }
}

// max|v| of `count` values; NaN if any is NaN.
inline float span_amax(const float* v, int64_t count) {
  float m = 0.0f;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t c = 0; c < count; ++c) {
    const float a = std::fabs(v[c]);
    m = a > m ? a : m;
    nan |= a != a;
  }
  return nan ? std::nanf("") : m;
}

// quant.guard_scale(amax / qmax): a zero scale becomes 1, NaN and Inf stay.
inline float scale_of(float amax, float qmax) {
  float s = amax / qmax;
  return s == 0.0f ? 1.0f : s;
}


// One butterfly stage of the Hadamard transform of 16 values held together: lane i becomes
// x[i] + x[i ^ h] where bit h of i is clear, x[i ^ h] − x[i] where it is set (exact: the ±1 is a sign).
inline Float16x butterfly(Float16x x, Int16x partner, Float16x sign) { return x * sign + permute(x, partner); }

// A block of 16 values times the Hadamard matrix, H[i][j] = (-1)^popcount(i & j) (Sylvester order, as
// hot_compile/runtime/hadamard.py builds it), in 4 stages of a shuffle and an add.
inline Float16x hadamard16(Float16x x) {
  x = butterfly(x, Int16x{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
                Float16x{1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1});
  x = butterfly(x, Int16x{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                Float16x{1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1});
  x = butterfly(x, Int16x{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                Float16x{1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1});
  return butterfly(x, Int16x{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                   Float16x{1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1});
}

// Lane-wise max|v| into m (magnitudes, from zero); a NaN wins. By the bits, as integers: a
// non-negative float orders as its bit pattern does, and a NaN's lies above Inf's, so one integer
// max does what a float compare, a NaN test and a blend do.
inline Float16x max_magnitude(Float16x m, Float16x v) {
  const Int16x a = bitcast<Int16x>(v) & 0x7fffffff, b = bitcast<Int16x>(m);
  return bitcast<Float16x>(SELECT(a > b, a, b));
}

// The largest of lane-wise maxima that max_magnitude gathered, NaN if a lane is: a tree of shuffles,
// without the branch per lane that a scalar loop compiles to (a cost per row, which short rows feel).
inline float lanes_max(Float16x m) {
  m = max_magnitude(m, permute(m, Int16x{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  m = max_magnitude(m, permute(m, Int16x{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  m = max_magnitude(m, permute(m, Int16x{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  m = max_magnitude(m, permute(m, Int16x{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return m[0];
}

#if defined(__AVX2__)
// dst[i][j] = src[j][i] ^ flip for a 16 × 32 block of bytes (rows `src_stride` and `dst_stride` apart):
// the 16 × 16 transposes of its two halves, one per 128-bit lane, in four rounds of interleaving pairs
// of registers: bytes, then pairs, quads and eights of them. Register h·8 + p of a round holds the low
// (h = 0) or high (h = 1) half of the interleave of the round before's registers 2p and 2p + 1, so
// after the fourth, register j holds source columns j and 16 + j, rows in order.
inline void transpose16x32(const int8_t* src, int64_t src_stride, int8_t* dst, int64_t dst_stride, int8_t flip) {
  const __m256i bits = _mm256_set1_epi8(flip);
  __m256i x[16], y[16];
  for (int i = 0; i < 16; ++i) {
    x[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * src_stride)), bits);
  }
  for (int p = 0; p < 8; ++p) {
    y[p] = _mm256_unpacklo_epi8(x[2 * p], x[2 * p + 1]);
    y[8 + p] = _mm256_unpackhi_epi8(x[2 * p], x[2 * p + 1]);
  }
  for (int g = 0; g < 2; ++g) {
    for (int p = 0; p < 4; ++p) {
      x[8 * g + p] = _mm256_unpacklo_epi16(y[8 * g + 2 * p], y[8 * g + 2 * p + 1]);
      x[8 * g + 4 + p] = _mm256_unpackhi_epi16(y[8 * g + 2 * p], y[8 * g + 2 * p + 1]);
    }
  }
  for (int g = 0; g < 4; ++g) {
    for (int p = 0; p < 2; ++p) {
      y[4 * g + p] = _mm256_unpacklo_epi32(x[4 * g + 2 * p], x[4 * g + 2 * p + 1]);
      y[4 * g + 2 + p] = _mm256_unpackhi_epi32(x[4 * g + 2 * p], x[4 * g + 2 * p + 1]);
    }
  }
  for (int g = 0; g < 8; ++g) {
    x[2 * g] = _mm256_unpacklo_epi64(y[2 * g], y[2 * g + 1]);
    x[2 * g + 1] = _mm256_unpackhi_epi64(y[2 * g], y[2 * g + 1]);
  }
  for (int j = 0; j < 16; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * dst_stride), _mm256_castsi256_si128(x[j]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (16 + j) * dst_stride), _mm256_extracti128_si256(x[j], 1));
  }
}
#endif

}  // namespace
