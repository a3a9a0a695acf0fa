// The attention backward as products (hot_compile/runtime/attention_ops.py): its elementwise step, and
// where the CPU has AVX512-BF16 the score products fused with it. On the primitives of
// cpu_primitives.cpp, which precede this file in one translation unit; exported with C linkage for
// hot_compile/runtime/cpu_kernels.py.

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
    const Float16x v = x[j] < -87.0f ? Float16x{} - 87.0f : x[j];
    x[j] = v > 88.0f ? Float16x{} + 88.0f : v;
    const Float16x t = x[j] * 1.44269504088896341f + 0.5f;
    n[j] = __builtin_convertvector(__builtin_convertvector(t, Int16x), Float16x);
    n[j] = n[j] > t ? n[j] - 1.0f : n[j];  // the conversion truncates; n is floor(t)
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
    x[j] = p[j] * (Float16x)((__builtin_convertvector(n[j], Int16x) + 127) << 23);
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
  const Float16x d = x * score_grad;
  for (int64_t j = 0; j < count; ++j) {
    store(x[j], p + j);
    store(d[j], ds + j);
  }
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
  const T* at(const T* x, int64_t index, int64_t heads) const {
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

#if defined(__AVX512F__)
// Rows of a score tile: two tiles of 12 × 32 float32 sums each fill 24 registers in turn.
constexpr int64_t SCORE_ROWS = 12, SCORE_COLS = 32;
// Vectors per call of probabilities_lanes in a tile's elementwise pass: both halves of three rows.
constexpr int TILE_CHAINS = 6;

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

// P = exp(scale·q kᵀ − lse) and dS = P ∘ scale·(g vᵀ − Δ) for `batch` × `heads` heads of [l, e] (q, g)
// and [s, e] (k, v) bf16 rows (e even), lse and Δ float32 [batch · heads, l] contiguous, into P and dS
// bf16 [batch · heads, l, s].
void attention_scores(const BFloat16* q, const BFloat16* k, const BFloat16* g, const BFloat16* v, int64_t batch,
                      int64_t heads, int64_t l, int64_t s, int64_t e, const HeadStrides* strides, const float* lse,
                      const float* delta, float scale, BFloat16* p, BFloat16* ds) {
  const HeadStrides& qs = strides[0], &ks = strides[1], &gs = strides[2], &vs = strides[3];
  const int64_t count = batch * heads, pairs = e / 2, padded = (s + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  const int64_t packed_size = padded * pairs, tiles = (l + SCORE_ROWS - 1) / SCORE_ROWS;
  // Left uninitialized: pack_pair_columns writes every entry, its padding included, in parallel (a
  // vector's zero fill ran on one thread while the other waited).
  const std::unique_ptr<uint32_t[]> keys(new uint32_t[count * packed_size]), values(new uint32_t[count * packed_size]);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t h = 0; h < count; ++h) {
      pack_pair_columns(ks.at(k, h, heads), s, pairs, ks.row, keys.get() + h * packed_size);
      pack_pair_columns(vs.at(v, h, heads), s, pairs, vs.row, values.get() + h * packed_size);
    }
    std::vector<uint32_t> q_rows(pairs * SCORE_ROWS), g_rows(pairs * SCORE_ROWS);
    alignas(64) float scores[SCORE_ROWS][SCORE_COLS], grads[SCORE_ROWS][SCORE_COLS];
#pragma omp for collapse(2) schedule(static)
    for (int64_t h = 0; h < count; ++h) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = t * SCORE_ROWS, rows = std::min(SCORE_ROWS, l - first);
        pack_pair_rows(qs.at(q, h, heads), first, l, pairs, qs.row, q_rows.data());
        pack_pair_rows(gs.at(g, h, heads), first, l, pairs, gs.row, g_rows.data());
        const uint32_t* key = keys.get() + h * packed_size;
        const uint32_t* value = values.get() + h * packed_size;
        for (int64_t c0 = 0; c0 < s; c0 += SCORE_COLS) {
          const int64_t block = c0 / 16 * pairs * 16;
          score_tile(q_rows.data(), key + block, key + block + pairs * 16, pairs, scores);
          score_tile(g_rows.data(), value + block, value + block + pairs * 16, pairs, grads);
          // Whole vectors TILE_CHAINS at a time (both halves of TILE_CHAINS / 2 rows), then the rest alone.
          const int64_t whole = std::min<int64_t>(SCORE_COLS, s - c0) / 16 * 16;
          const int64_t paired_rows = whole == SCORE_COLS ? rows / (TILE_CHAINS / 2) * (TILE_CHAINS / 2) : 0;
          Float16x x[TILE_CHAINS], grad[TILE_CHAINS];
          for (int64_t r = 0; r < paired_rows; r += TILE_CHAINS / 2) {
            const int64_t row = h * l + first + r;
            for (int j = 0; j < TILE_CHAINS; ++j) {
              x[j] = load16(scores[r + j / 2] + 16 * (j % 2)) * scale - lse[row + j / 2];
              grad[j] = (load16(grads[r + j / 2] + 16 * (j % 2)) - delta[row + j / 2]) * scale;
            }
            probabilities_lanes<TILE_CHAINS>(x, grad, p + row * s + c0, ds + row * s + c0,
                                             [s](int j) { return j / 2 * s + 16 * (j % 2); });
          }
          for (int64_t r = paired_rows; r < rows; ++r) {
            const int64_t row = h * l + first + r;
            for (int64_t half = 0; half < SCORE_COLS && c0 + half < s; half += 16) {
              x[0] = load16(scores[r] + half) * scale - lse[row];
              grad[0] = (load16(grads[r] + half) - delta[row]) * scale;
              const int64_t at = row * s + c0 + half;
              if (half < whole) {
                probabilities_lanes<1>(x, grad, p + at, ds + at, [](int) { return 0; });
              } else {
                probabilities_tail(x[0], grad[0], s - c0 - half, p + at, ds + at);
              }
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
