// The elementwise step of the attention backward as products (hot_compile/runtime/attention_ops.py), on
// the primitives of cpu_primitives.cpp, which precede this file in one translation unit; exported with C
// linkage for hot_compile/runtime/cpu_kernels.py.

namespace {

// e^x in float32 for x ≤ 88, as Cephes' expf, 16 lanes at a time: x = n·ln2 + r with |r| ≤ ln2/2 (ln2 in
// two parts, so r is exact), e^r by its degree-7 polynomial, 2^n written into the exponent bits. Below
// −87 the result is e^−87, not a subnormal: a probability under 2⁻¹²⁵ in a softmax row whose largest is
// near 1.
inline Float16x exp16(Float16x x) {
  const Float16x low = Float16x{} - 87.0f, high = Float16x{} + 88.0f;
  x = x < low ? low : x;
  x = x > high ? high : x;
  const Float16x t = x * 1.44269504088896341f + 0.5f;
  Float16x n = __builtin_convertvector(__builtin_convertvector(t, Int16x), Float16x);
  n = n > t ? n - 1.0f : n;  // the conversion truncates; n is floor(t)
  const Float16x r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Float16x p = Float16x{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * (Float16x)((__builtin_convertvector(n, Int16x) + 127) << 23);
}

// P = e^x and dS = P · score_grad for `count` ≤ 16 values, each rounded to Out by `store`.
template <typename Out>
inline void probabilities16(Float16x x, Float16x score_grad, int64_t count, Out* p, Out* ds) {
  const Float16x e = exp16(x), d = e * score_grad;
#pragma omp simd
  for (int64_t j = 0; j < count; ++j) {
    store(e[j], p + j);
    store(d[j], ds + j);
  }
}

// P = e^shifted and dS = P · score_grad, each written once in the output dtype.
template <typename Out>
void probabilities_and_score_grad(const float* shifted, const float* score_grad, int64_t count, Out* p, Out* ds) {
  constexpr int64_t SPAN = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < count; c += SPAN) {
    const int64_t stop = std::min(count, c + SPAN);
    int64_t i = c;
    for (; i + 16 <= stop; i += 16) probabilities16(load16(shifted + i), load16(score_grad + i), 16, p + i, ds + i);
    if (i < stop) probabilities16(load16(shifted + i, stop - i), load16(score_grad + i, stop - i), stop - i, p + i, ds + i);
  }
}

}  // namespace

extern "C" {

void hot_attention_probabilities(const float* shifted, const float* score_grad, int64_t count, int64_t dtype, void* p,
                                 void* ds) {
  switch (dtype) {
    case FLOAT32:
      return probabilities_and_score_grad(shifted, score_grad, count, static_cast<float*>(p), static_cast<float*>(ds));
    case BFLOAT16:
      return probabilities_and_score_grad(shifted, score_grad, count, static_cast<BFloat16*>(p), static_cast<BFloat16*>(ds));
    default:
      return probabilities_and_score_grad(shifted, score_grad, count, static_cast<_Float16*>(p), static_cast<_Float16*>(ds));
  }
}

}  // extern "C"
