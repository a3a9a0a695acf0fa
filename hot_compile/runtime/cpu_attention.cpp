// The attention backward as products (hot_compile/runtime/attention_ops.py) where the scores are stored:
// its elementwise step, and Δ = rowsum(dO ∘ O). On the primitives of cpu_primitives.cpp, which precede
// this file in one translation unit; exported with C linkage for hot_compile/runtime/cpu_kernels.py.

namespace {

// e^x in float32 for x ≤ 88, as Cephes' expf, for K vectors of 16 lanes in place: x = n·ln2 + r with
// |r| ≤ ln2/2 (ln2 in two parts, so r is exact), e^r by its degree-7 polynomial, 2^n written into the
// exponent bits. Below −87 the result is e^−87, not a subnormal: a probability under 2⁻¹²⁵ in a softmax
// row whose largest is near 1. Each step runs on all K vectors before the next, so that K chains of
// dependent multiplies and adds are in flight at once: one vector's polynomial alone is latency-bound.
template <int K>
inline void exp_lanes(Float16x* x) {
  Float16x n[K], r[K], p[K];
#pragma GCC unroll 8
  for (int j = 0; j < K; ++j) {
    const Float16x v = SELECT(x[j] < -87.0f, Float16x{} - 87.0f, x[j]);
    x[j] = SELECT(v > 88.0f, Float16x{} + 88.0f, v);
    const Float16x t = x[j] * 1.44269504088896341f + 0.5f;
    n[j] = convert<Float16x>(convert<Int16x>(t));
    n[j] = SELECT(n[j] > t, n[j] - 1.0f, n[j]);  // the conversion truncates; n is floor(t)
  }
#pragma GCC unroll 8
  for (int j = 0; j < K; ++j) r[j] = x[j] - n[j] * 0.693359375f + n[j] * 2.12194440e-4f;
#pragma GCC unroll 8
  for (int j = 0; j < K; ++j) p[j] = r[j] * 1.9875691500e-4f + 1.3981999507e-3f;
  constexpr float COEFFICIENTS[] = {8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  for (const float c : COEFFICIENTS) {
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) p[j] = p[j] * r[j] + c;
  }
#pragma GCC unroll 8
  for (int j = 0; j < K; ++j) {
    p[j] = p[j] * r[j] * r[j] + r[j] + 1.0f;
    x[j] = p[j] * bitcast<Float16x>((convert<Int16x>(n[j]) + 127) << 23);
  }
}

// P = e^x and dS = P · score_grad for K whole vectors, each value rounded to Out once; vector j of
// both goes to offset at(j).
template <int K, typename Out, typename At>
inline void probabilities_lanes(Float16x* x, const Float16x* score_grad, Out* p, Out* ds, At at) {
  exp_lanes<K>(x);
#pragma GCC unroll 8
  for (int j = 0; j < K; ++j) {
    store16(x[j], p + at(j));
    store16(x[j] * score_grad[j], ds + at(j));
  }
}

// The same for `count` < 16 values.
template <typename Out>
inline void probabilities_tail(Float16x x, Float16x score_grad, int64_t count, Out* p, Out* ds) {
  exp_lanes<1>(&x);
  store_lanes(x, count, p);
  store_lanes(x * score_grad, count, ds);
}

// Vectors per call of probabilities_lanes: four chains hide the polynomial's latency on Zen 4.
constexpr int EXP_CHAINS = 4;

// P = e^shifted and dS = P · score_grad, each written once in the output dtype.
template <typename Out>
void probabilities_and_score_grad(const float* shifted, const float* score_grad, int64_t count, Out* p, Out* ds) {
  constexpr int64_t SPAN = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < count; c += SPAN) {
    const int64_t stop = std::min(count, c + SPAN);
    int64_t i = c;
    for (; i + 16 * EXP_CHAINS <= stop; i += 16 * EXP_CHAINS) {
      Float16x x[EXP_CHAINS], g[EXP_CHAINS];
      for (int j = 0; j < EXP_CHAINS; ++j) x[j] = load16(shifted + i + 16 * j), g[j] = load16(score_grad + i + 16 * j);
      probabilities_lanes<EXP_CHAINS>(x, g, p + i, ds + i, [](int j) { return 16 * j; });
    }
    for (; i + 16 <= stop; i += 16) {
      Float16x x = load16(shifted + i), g = load16(score_grad + i);
      probabilities_lanes<1>(&x, &g, p + i, ds + i, [](int) { return 0; });
    }
    if (i < stop) probabilities_tail(load16(shifted + i, stop - i), load16(score_grad + i, stop - i), stop - i, p + i, ds + i);
  }
}

// The strides of one [batch, heads, rows, e] operand, in values: batch entry, head, row (values contiguous).
struct HeadStrides {
  int64_t batch, head, row;
  template <typename T>
  T* at(T* x, int64_t index, int64_t heads) const {
    return x + index / heads * batch + index % heads * head;
  }
};

// Δ = Σₑ g·o, summed in float32, for each of the batch × heads × l rows of g and o (strides: g's, then
// o's), into delta [batch · heads · l].
template <typename T>
void row_dots(const T* g, const T* o, int64_t batch, int64_t heads, int64_t l, int64_t e, const HeadStrides* strides,
              float* delta) {
  const HeadStrides& gs = strides[0], &os = strides[1];
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < batch * heads; ++h) {
    const T* g_rows = gs.at(g, h, heads);
    const T* o_rows = os.at(o, h, heads);
    for (int64_t i = 0; i < l; ++i) {
      const T* gi = g_rows + i * gs.row;
      const T* oi = o_rows + i * os.row;
      Float16x lanes = {};
      int64_t j = 0;
      for (; j + 16 <= e; j += 16) lanes += load16(gi + j) * load16(oi + j);
      float sum = 0.0f;
      for (int c = 0; c < 16; ++c) sum += lanes[c];
      for (; j < e; ++j) sum += to_float(gi[j]) * to_float(oi[j]);
      delta[h * l + i] = sum;
    }
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

// row_dots(), `strides` the batch, head and row strides of g, then of o.
void hot_attention_row_dots(const void* g, const void* o, int64_t dtype, int64_t batch, int64_t heads, int64_t l,
                            int64_t e, const int64_t* strides, float* delta) {
  const auto* head_strides = reinterpret_cast<const HeadStrides*>(strides);
  switch (dtype) {
    case FLOAT32:
      return row_dots(static_cast<const float*>(g), static_cast<const float*>(o), batch, heads, l, e, head_strides, delta);
    case BFLOAT16:
      return row_dots(static_cast<const BFloat16*>(g), static_cast<const BFloat16*>(o), batch, heads, l, e, head_strides,
                      delta);
    default:
      return row_dots(static_cast<const _Float16*>(g), static_cast<const _Float16*>(o), batch, heads, l, e, head_strides,
                      delta);
  }
}

}  // extern "C"
