// The attention backward as products (hot_compile/runtime/attention_ops.py): its elementwise step, and
// where the CPU has AVX512-BF16 the score products fused with it. On the primitives of
// cpu_primitives.cpp, which precede this file in one translation unit; exported with C linkage for
// hot_compile/runtime/cpu_kernels.py.

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

#if defined(__AVX512F__)
// Rows of a score tile: two tiles of 12 × 32 float32 sums each fill 24 registers in turn.
constexpr int64_t SCORE_ROWS = 12, SCORE_COLS = 32;

inline uint32_t pair_at(const BFloat16* row, int64_t pair) {
  uint32_t bits;
  std::memcpy(&bits, row + 2 * pair, sizeof bits);
  return bits;
}

// The value pairs of `count` rows (row_stride apart) as vdpbf16ps takes its vector operand: for each
// block of 16 rows and each pair p, the 16 rows' pairs (x[i][2p], x[i][2p + 1]) in row order; rows past
// `count` up to a whole SCORE_COLS are zero.
void pack_pair_columns(const BFloat16* x, int64_t count, int64_t pairs, int64_t row_stride, uint32_t* packed) {
  const int64_t padded = (count + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  for (int64_t j = 0; j < padded; ++j) {
    uint32_t* out = packed + (j / 16) * pairs * 16 + j % 16;
    for (int64_t p = 0; p < pairs; ++p) out[p * 16] = j < count ? pair_at(x + j * row_stride, p) : 0;
  }
}

// The pairs of SCORE_ROWS rows from `first` (the last row repeated past `count`), pair-major, as the
// broadcast operand.
void pack_pair_rows(const BFloat16* x, int64_t first, int64_t count, int64_t pairs, int64_t row_stride, uint32_t* packed) {
  for (int64_t r = 0; r < SCORE_ROWS; ++r) {
    const BFloat16* row = x + std::min(first + r, count - 1) * row_stride;
    for (int64_t p = 0; p < pairs; ++p) packed[p * SCORE_ROWS + r] = pair_at(row, p);
  }
}

// sums[r][c] = Σₚ a-pair · b-pair over `pairs`, for a tile of SCORE_ROWS rows (packed by pack_pair_rows)
// and SCORE_COLS columns (two blocks of pack_pair_columns): products of bf16 exact in float32, summed in float32.
__attribute__((target("avx512bf16"))) void score_tile(const uint32_t* a, const uint32_t* b0, const uint32_t* b1,
                                                       int64_t pairs, float (*sums)[SCORE_COLS]) {
  __m512 acc[SCORE_ROWS][2];
#pragma GCC unroll 12
  for (int r = 0; r < SCORE_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + p * 16), v1 = (__m512bh)_mm512_loadu_si512(b1 + p * 16);
#pragma GCC unroll 12
    for (int r = 0; r < SCORE_ROWS; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(int32_t(a[p * SCORE_ROWS + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, v0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, v1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < SCORE_ROWS; ++r) {
    _mm512_storeu_ps(sums[r], acc[r][0]);
    _mm512_storeu_ps(sums[r] + 16, acc[r][1]);
  }
}

// The strides of one operand of attention_scores(), in values: batch entry, head, row (values contiguous).
struct HeadStrides {
  int64_t batch, head, row;
  const BFloat16* at(const BFloat16* x, int64_t index, int64_t heads) const {
    return x + index / heads * batch + index % heads * head;
  }
};

// P = exp(scale·q kᵀ − lse) and dS = P ∘ scale·(g vᵀ − Δ) for `batch` × `heads` heads of [l, e] (q, g)
// and [s, e] (k, v) bf16 rows (e even), lse and Δ float32 [batch · heads, l] contiguous, into P and dS
// bf16 [batch · heads, l, s].
void attention_scores(const BFloat16* q, const BFloat16* k, const BFloat16* g, const BFloat16* v, int64_t batch,
                      int64_t heads, int64_t l, int64_t s, int64_t e, const HeadStrides* strides, const float* lse,
                      const float* delta, float scale, BFloat16* p, BFloat16* ds) {
  const HeadStrides& qs = strides[0], &ks = strides[1], &gs = strides[2], &vs = strides[3];
  const int64_t count = batch * heads, pairs = e / 2, padded = (s + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  const int64_t packed_size = padded * pairs, tiles = (l + SCORE_ROWS - 1) / SCORE_ROWS;
  std::vector<uint32_t> keys(count * packed_size), values(count * packed_size);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t h = 0; h < count; ++h) {
      pack_pair_columns(ks.at(k, h, heads), s, pairs, ks.row, keys.data() + h * packed_size);
      pack_pair_columns(vs.at(v, h, heads), s, pairs, vs.row, values.data() + h * packed_size);
    }
    std::vector<uint32_t> q_rows(pairs * SCORE_ROWS), g_rows(pairs * SCORE_ROWS);
    alignas(64) float scores[SCORE_ROWS][SCORE_COLS], grads[SCORE_ROWS][SCORE_COLS];
#pragma omp for collapse(2) schedule(static)
    for (int64_t h = 0; h < count; ++h) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = t * SCORE_ROWS, rows = std::min(SCORE_ROWS, l - first);
        pack_pair_rows(qs.at(q, h, heads), first, l, pairs, qs.row, q_rows.data());
        pack_pair_rows(gs.at(g, h, heads), first, l, pairs, gs.row, g_rows.data());
        const uint32_t* key = keys.data() + h * packed_size;
        const uint32_t* value = values.data() + h * packed_size;
        for (int64_t c0 = 0; c0 < s; c0 += SCORE_COLS) {
          const int64_t block = c0 / 16 * pairs * 16;
          score_tile(q_rows.data(), key + block, key + block + pairs * 16, pairs, scores);
          score_tile(g_rows.data(), value + block, value + block + pairs * 16, pairs, grads);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = h * l + first + r;
            for (int64_t half = 0; half < SCORE_COLS && c0 + half < s; half += 16) {
              const Float16x shifted = load16(scores[r] + half) * scale - lse[row];
              const Float16x score_grad = (load16(grads[r] + half) - delta[row]) * scale;
              const int64_t at = row * s + c0 + half;
              probabilities16(shifted, score_grad, std::min<int64_t>(16, s - c0 - half), p + at, ds + at);
            }
          }
        }
      }
    }
  }
}
#endif

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

int64_t hot_attention_scores_compiled() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// attention_scores(), `strides` the batch, head and row strides of q, k, g and v in turn; the caller has
// checked hot_attention_scores_compiled() and that the CPU has AVX512-BF16.
void hot_attention_scores(const void* q, const void* k, const void* g, const void* v, int64_t batch, int64_t heads,
                          int64_t l, int64_t s, int64_t e, const int64_t* strides, const float* lse, const float* delta,
                          float scale, void* p, void* ds) {
#if defined(__AVX512F__)
  attention_scores(static_cast<const BFloat16*>(q), static_cast<const BFloat16*>(k), static_cast<const BFloat16*>(g),
                   static_cast<const BFloat16*>(v), batch, heads, l, s, e, reinterpret_cast<const HeadStrides*>(strides),
                   lse, delta, scale, static_cast<BFloat16*>(p), static_cast<BFloat16*>(ds));
#endif
}

}  // extern "C"
