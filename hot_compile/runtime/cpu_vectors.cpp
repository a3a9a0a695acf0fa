// The 16-lane vectors of HOT's CPU kernels, first in their translation unit (cpu_primitives.cpp and the
// rest follow): 16 float, int32 or uint32 lanes as one value, and the operations the kernels take of
// them beyond arithmetic, comparison and lane reads.
//
// Where the target has 64-byte registers (AVX-512) or none wider than 16 bytes, a vector is GCC's
// vector extension of 64 bytes. On AVX2, GCC has no register for such a type: it keeps each one in
// memory and moves it through the stack between operations, and narrows lanes one at a time; the
// AVX2 build's kernels ran 4–14× slower than the AVX-512 build's on the same core. There a vector is
// two 32-byte halves, each a vector extension GCC keeps in a register. Both forms compute the same
// lanes with the same instructions' rounding, so the two builds' results are bit-identical.

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef int8_t Int8x16 __attribute__((vector_size(16)));
typedef uint8_t UInt8x16 __attribute__((vector_size(16)));
typedef uint16_t UInt16x16 __attribute__((vector_size(32)));
typedef _Float16 Half16x __attribute__((vector_size(32)));

#if defined(__AVX2__) && !defined(__AVX512F__)
#define HOT_VECTOR_HALVES 1

template <typename T>
struct Lanes16 {
  typedef T Half __attribute__((vector_size(32)));
  Half lo, hi;

  Lanes16() = default;  // trivial: `Float16x{}` is zero, as the vector extension's
  Lanes16(Half low, Half high) : lo(low), hi(high) {}
  template <typename... V, typename = std::enable_if_t<sizeof...(V) == 16>>
  Lanes16(V... values) {
    const T lanes[16] = {T(values)...};
    std::memcpy(this, lanes, sizeof lanes);
  }
  T operator[](int64_t i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};

template <typename T>
inline Lanes16<T> operator-(Lanes16<T> a) {
  return {-a.lo, -a.hi};
}

// An operator on the halves, with a vector or a scalar on either side: the lanes it gives are
// `Result`'s, the operands' for arithmetic, int32 ones (all ones where it holds) for a comparison.
#define HOT_LANES16_OPERATOR(op, Result)                                                          \
  template <typename T>                                                                           \
  inline Result operator op(Lanes16<T> a, Lanes16<T> b) {                                         \
    return {a.lo op b.lo, a.hi op b.hi};                                                          \
  }                                                                                               \
  template <typename T, typename S, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>          \
  inline Result operator op(Lanes16<T> a, S b) {                                                  \
    return {a.lo op T(b), a.hi op T(b)};                                                          \
  }                                                                                               \
  template <typename T, typename S, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>          \
  inline Result operator op(S a, Lanes16<T> b) {                                                  \
    return {T(a) op b.lo, T(a) op b.hi};                                                          \
  }
#define HOT_LANES16_ARITHMETIC(op)                                                                \
  HOT_LANES16_OPERATOR(op, Lanes16<T>)                                                            \
  template <typename T, typename B>                                                               \
  inline Lanes16<T>& operator op##=(Lanes16<T>& a, B b) {                                         \
    return a = a op b;                                                                            \
  }
HOT_LANES16_ARITHMETIC(+)
HOT_LANES16_ARITHMETIC(-)
HOT_LANES16_ARITHMETIC(*)
HOT_LANES16_ARITHMETIC(/)
HOT_LANES16_ARITHMETIC(&)
HOT_LANES16_ARITHMETIC(|)
HOT_LANES16_ARITHMETIC(^)
HOT_LANES16_ARITHMETIC(<<)
HOT_LANES16_ARITHMETIC(>>)
HOT_LANES16_OPERATOR(<, Lanes16<int32_t>)
HOT_LANES16_OPERATOR(>, Lanes16<int32_t>)
HOT_LANES16_OPERATOR(==, Lanes16<int32_t>)
#undef HOT_LANES16_ARITHMETIC
#undef HOT_LANES16_OPERATOR

typedef Lanes16<float> Float16x;
typedef Lanes16<int32_t> Int16x;
typedef Lanes16<uint32_t> UInt16x;

// The vector V at p, and v stored at p, a half at a time: copied whole, the struct went through the
// stack in 16-byte pieces, and the 32-byte loads after them waited for those stores.
template <typename V, typename T>
inline V vector_load(const T* p) {
  typename V::Half half[2];
  std::memcpy(&half[0], p, sizeof half[0]);
  std::memcpy(&half[1], reinterpret_cast<const char*>(p) + sizeof half[0], sizeof half[1]);
  return {half[0], half[1]};
}
template <typename U, typename T>
inline void vector_store(Lanes16<U> v, T* p) {
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(reinterpret_cast<char*>(p) + sizeof v.lo, &v.hi, sizeof v.hi);
}
#else
typedef float Float16x __attribute__((vector_size(64)));
typedef int32_t Int16x __attribute__((vector_size(64)));
typedef uint32_t UInt16x __attribute__((vector_size(64)));

// The vector V at p, and v stored at p: its 64 bytes, in memory order.
template <typename V, typename T>
inline V vector_load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V, typename T>
inline void vector_store(V v, T* p) {
  std::memcpy(p, &v, sizeof v);
}
#endif

// Lane-wise `mask ? a : b` (mask: a comparison's lanes), for scalars the conditional. A macro where
// the vector extension is the type: passed through a function, the comparison is no longer folded
// into the conditional, and GCC wrote a compare and a blend where `a > b ? a : b` was one max.
#if defined(HOT_VECTOR_HALVES)
#define SELECT(mask, a, b) select_halves(mask, a, b)
#else
#define SELECT(mask, a, b) ((mask) ? (a) : (b))
#endif

// The lanes of v as the vector type To holds them (as __builtin_convertvector: float to integer
// truncates). A narrowing to 8 or 16 bits takes lanes within the narrow type's range.
template <typename To, typename From>
inline To convert(From v) {
  return __builtin_convertvector(v, To);
}

// v's bits as the vector type To of the same size.
template <typename To, typename From>
inline To bitcast(From v) {
  return (To)v;
}

// Lane i of the result is lane index[i] of v.
template <typename V>
inline V permute(V v, Int16x index) {
  return __builtin_shuffle(v, index);
}

#if defined(HOT_VECTOR_HALVES)
template <typename T>
inline Lanes16<T> select_halves(Int16x mask, Lanes16<T> a, Lanes16<T> b) {
  return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}
inline uint32_t select_halves(bool mask, uint32_t a, uint32_t b) { return mask ? a : b; }

template <typename To, typename T>
inline To convert(Lanes16<T> v) {
  if constexpr (std::is_same_v<To, Int8x16> || std::is_same_v<To, UInt8x16>) {
    // Saturating packs: exact for lanes in range. Each packs the halves' 128-bit lanes in turn.
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32((__m256i)v.lo, (__m256i)v.hi), 0xD8);
    return (To)_mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  } else if constexpr (std::is_same_v<To, UInt16x16>) {
    return (To)_mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)v.lo, (__m256i)v.hi), 0xD8);
  } else if constexpr (std::is_same_v<To, Half16x>) {
    typedef _Float16 Half8x __attribute__((vector_size(16)));
    const Half8x halves[2] = {__builtin_convertvector(v.lo, Half8x), __builtin_convertvector(v.hi, Half8x)};
    To out;
    std::memcpy(&out, halves, sizeof out);
    return out;
  } else {
    return {__builtin_convertvector(v.lo, typename To::Half), __builtin_convertvector(v.hi, typename To::Half)};
  }
}

// 16 narrow lanes widened: each half of them into one half of To.
template <typename To, typename Narrow>
inline To widen(Narrow v) {
  typedef std::remove_reference_t<decltype(v[0])> Lane;
  typedef Lane Narrow8x __attribute__((vector_size(sizeof(Narrow) / 2)));
  Narrow8x halves[2];
  std::memcpy(halves, &v, sizeof v);
  return {__builtin_convertvector(halves[0], typename To::Half), __builtin_convertvector(halves[1], typename To::Half)};
}
template <>
inline Float16x convert<Float16x, Half16x>(Half16x v) {
  return widen<Float16x>(v);
}
template <>
inline UInt16x convert<UInt16x, UInt16x16>(UInt16x16 v) {
  return widen<UInt16x>(v);
}

template <typename To, typename T>
inline To bitcast(Lanes16<T> v) {
  return {(typename To::Half)v.lo, (typename To::Half)v.hi};
}

template <typename T>
inline Lanes16<T> permute(Lanes16<T> v, Int16x index) {
  return {__builtin_shuffle(v.lo, v.hi, index.lo), __builtin_shuffle(v.lo, v.hi, index.hi)};
}
#endif

}  // namespace
