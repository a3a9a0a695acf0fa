// The attention backward as products (hot_compile/runtime/attention_ops.py): its elementwise step, and
// where the CPU has AVX512-BF16 the whole backward, a head at a time, on its pair products. On the
// primitives of cpu_primitives.cpp, which precede this file in one translation unit; exported with C
// linkage for hot_compile/runtime/cpu_kernels.py.

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

// sums[r][c] = Σₚ a-pair · b-pair over `pairs`, for a tile of SCORE_ROWS rows (pair-major: pair p of each
// row from a + p · a_stride, as pack_pair_rows packs them with a_stride = SCORE_ROWS) and SCORE_COLS
// columns (two blocks of 16 columns' pairs, as pack_pair_columns and pair_rows pack them): products of
// bf16 exact in float32, summed in float32.
__attribute__((target("avx512bf16"))) void score_tile(const uint32_t* a, int64_t a_stride, const uint32_t* b0,
                                                       const uint32_t* b1, int64_t pairs, float (*sums)[SCORE_COLS]) {
  __m512 acc[SCORE_ROWS][2];
#pragma GCC unroll 12
  for (int r = 0; r < SCORE_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + p * 16), v1 = (__m512bh)_mm512_loadu_si512(b1 + p * 16);
#pragma GCC unroll 12
    for (int r = 0; r < SCORE_ROWS; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(int32_t(a[p * a_stride + r]));
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

// The P and dS of one head's l query rows into p and ds (row stride ld): keys and values packed by
// pack_pair_columns, lse and delta the head's rows.
void head_scores(const BFloat16* q, int64_t q_row, const BFloat16* g, int64_t g_row, const uint32_t* key,
                 const uint32_t* value, int64_t l, int64_t s, int64_t pairs, const float* lse, const float* delta,
                 float scale, uint32_t* q_rows, uint32_t* g_rows, BFloat16* p, BFloat16* ds, int64_t ld) {
  alignas(64) float scores[SCORE_ROWS][SCORE_COLS], grads[SCORE_ROWS][SCORE_COLS];
  for (int64_t first = 0; first < l; first += SCORE_ROWS) {
    const int64_t rows = std::min(SCORE_ROWS, l - first);
    pack_pair_rows(q, first, l, pairs, q_row, q_rows);
    pack_pair_rows(g, first, l, pairs, g_row, g_rows);
    for (int64_t c0 = 0; c0 < s; c0 += SCORE_COLS) {
      const int64_t block = c0 / 16 * pairs * 16;
      score_tile(q_rows, SCORE_ROWS, key + block, key + block + pairs * 16, pairs, scores);
      score_tile(g_rows, SCORE_ROWS, value + block, value + block + pairs * 16, pairs, grads);
      const int64_t whole = std::min<int64_t>(SCORE_COLS, s - c0) / 16 * 16;
      const int64_t paired_rows = whole == SCORE_COLS ? rows / (TILE_CHAINS / 2) * (TILE_CHAINS / 2) : 0;
      Float16x x[TILE_CHAINS], grad[TILE_CHAINS];
      for (int64_t r = 0; r < paired_rows; r += TILE_CHAINS / 2) {
        const int64_t row = first + r;
        for (int j = 0; j < TILE_CHAINS; ++j) {
          x[j] = load16(scores[r + j / 2] + 16 * (j % 2)) * scale - lse[row + j / 2];
          grad[j] = (load16(grads[r + j / 2] + 16 * (j % 2)) - delta[row + j / 2]) * scale;
        }
        probabilities_lanes<TILE_CHAINS>(x, grad, p + row * ld + c0, ds + row * ld + c0,
                                         [ld](int j) { return j / 2 * ld + 16 * (j % 2); });
      }
      for (int64_t r = paired_rows; r < rows; ++r) {
        const int64_t row = first + r;
        for (int64_t half = 0; half < SCORE_COLS && c0 + half < s; half += 16) {
          x[0] = load16(scores[r] + half) * scale - lse[row];
          grad[0] = (load16(grads[r] + half) - delta[row]) * scale;
          const int64_t at = row * ld + c0 + half;
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

// x's rows interleaved by pairs: out[(c / 16) · block_stride + i · pair_stride + c % 16] holds (x[2i][c], x[2i + 1][c])
// for each pair i < ⌈rows / 2⌉ and column c < padded (a multiple of 16), zero past `rows` and past `cols`. With
// block_stride = 16 · ⌈rows / 2⌉ and pair_stride = 16, the vector operand of a product that contracts x's rows; with
// block_stride = 16, the broadcast operand of one whose rows are x's columns.
void pair_rows(const BFloat16* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t padded, int64_t block_stride,
               int64_t pair_stride, uint32_t* out) {
  for (int64_t i = 0; i < (rows + 1) / 2; ++i) {
    const BFloat16* even = x + 2 * i * row_stride;
    const bool odd = 2 * i + 1 < rows;
    for (int64_t c = 0; c < padded; c += 16) {
      const __mmask16 lanes = c + 16 <= cols ? __mmask16(0xFFFF) : c < cols ? __mmask16((1u << (cols - c)) - 1) : __mmask16(0);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, even + c));
      const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, even + row_stride + c)) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + c / 16 * block_stride + i * pair_stride, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// A row of a product's float32 sums (`width` values) into a gradient: rounded once into out, after adding the
// sums of earlier query blocks kept in acc (unless `first`), or, short of the `last` block, kept in acc.
inline void gradient_row(const float* sums, int64_t width, float* acc, bool first, bool last, BFloat16* out) {
  for (int64_t c = 0; c < width; c += 16) {
    Float16x v = load16(sums + c);
    if (!first) v += load16(acc + c);
    if (!last) {
      store16(v, acc + c);
    } else if (c + 16 <= width) {
      store16(v, out + c);
    } else {
      for (int64_t j = 0; j < width - c; ++j) store(v[j], out + c + j);
    }
  }
}

// emit(r, c0, width, sums) for each row r < rows of the product Σᵢ a(r, i) · b(i, c) over `pairs` pairs, in blocks of
// SCORE_COLS columns c0 (width of them short of cols), summed in float32: a_tile(r0) gives SCORE_ROWS rows' pairs
// from r0, pair-major (a pointer and its pair stride), b is packed by pair_rows (16 · pairs per block of 16 columns,
// whole SCORE_COLS blocks).
template <typename ATile, typename Emit>
void pair_product(ATile a_tile, const uint32_t* b, int64_t pairs, int64_t rows, int64_t cols, Emit emit) {
  alignas(64) float sums[SCORE_ROWS][SCORE_COLS];
  for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
    const auto [a, a_stride] = a_tile(r0);
    for (int64_t c0 = 0; c0 < cols; c0 += SCORE_COLS) {
      const uint32_t* b0 = b + c0 / 16 * pairs * 16;
      score_tile(a, a_stride, b0, b0 + pairs * 16, pairs, sums);
      for (int64_t r = 0; r < std::min(SCORE_ROWS, rows - r0); ++r) emit(r0 + r, c0, std::min(SCORE_COLS, cols - c0), sums[r]);
    }
  }
}

// Query rows of a head a thread takes at a time: the block's P and dS and their pairs (8 bytes a score) within
// its caches. A head of ViT-S or MiniLM is one block.
constexpr int64_t QUERY_BLOCK_BYTES = 1 << 20;

// dQ, dK and dV of `batch` × `heads` heads, one head at a time on a thread, its queries in blocks: the block's P and
// dS (head_scores), then
//   dV = Pᵀ dO,   dK = dSᵀ Q,   dQ = dS K
// on vdpbf16ps from operands interleaved by pairs along the contraction. dQ's rows of a block are whole; dK and dV
// sum over the blocks in float32, rounded after the last. strides: q, k, g, v, dq, dk, dv's.
void attention_backward(const BFloat16* q, const BFloat16* k, const BFloat16* g, const BFloat16* v, int64_t batch,
                        int64_t heads, int64_t l, int64_t s, int64_t e, const HeadStrides* strides, const float* lse,
                        const float* delta, float scale, BFloat16* dq, BFloat16* dk, BFloat16* dv) {
  const HeadStrides &qs = strides[0], &ks = strides[1], &gs = strides[2], &vs = strides[3];
  const HeadStrides &dqs = strides[4], &dks = strides[5], &dvs = strides[6];
  const auto round_up = [](int64_t x, int64_t to) { return (x + to - 1) / to * to; };
  const int64_t pairs = e / 2, s_pairs = (s + 1) / 2;
  const int64_t ld = round_up(s, SCORE_COLS), columns = round_up(e, SCORE_COLS);
  const int64_t block = std::min(round_up(l, SCORE_ROWS), std::max<int64_t>(1, QUERY_BLOCK_BYTES / (8 * ld * SCORE_ROWS)) * SCORE_ROWS);
  const int64_t block_pairs = block / 2;  // SCORE_ROWS is even
  // The broadcast rows of Pᵀ and dSᵀ: a whole tile of SCORE_ROWS past any key row.
  const int64_t key_stride = ld + 16;
#pragma omp parallel
  {
    std::vector<uint32_t> keys(ld * pairs), values(ld * pairs), q_rows(pairs * SCORE_ROWS), g_rows(pairs * SCORE_ROWS);
    // Zero past column s: dQ's pairs of dS reach column s where s is odd.
    std::vector<BFloat16> p(block * ld), ds(block * ld);
    std::vector<uint32_t> p_pairs(block_pairs * key_stride), ds_pairs(block_pairs * key_stride), ds_rows(s_pairs * SCORE_ROWS);
    std::vector<uint32_t> q_pairs(columns * block_pairs), g_pairs(columns * block_pairs), k_pairs(columns * s_pairs);
    std::vector<float> dk_sums(block < l ? s * columns : 0), dv_sums(dk_sums.size());
#pragma omp for schedule(static)
    for (int64_t h = 0; h < batch * heads; ++h) {
      const BFloat16 *qh = qs.at(q, h, heads), *kh = ks.at(k, h, heads), *gh = gs.at(g, h, heads), *vh = vs.at(v, h, heads);
      BFloat16 *dqh = dqs.at(dq, h, heads), *dkh = dks.at(dk, h, heads), *dvh = dvs.at(dv, h, heads);
      pack_pair_columns(kh, s, pairs, ks.row, keys.data());
      pack_pair_columns(vh, s, pairs, vs.row, values.data());
      pair_rows(kh, s, e, ks.row, columns, 16 * s_pairs, 16, k_pairs.data());
      for (int64_t first = 0; first < l; first += block) {
        const int64_t rows = std::min(block, l - first), row_pairs = (rows + 1) / 2;
        const bool first_block = first == 0, last_block = first + rows == l;
        head_scores(qh + first * qs.row, qs.row, gh + first * gs.row, gs.row, keys.data(), values.data(), rows, s, pairs,
                    lse + h * l + first, delta + h * l + first, scale, q_rows.data(), g_rows.data(), p.data(), ds.data(), ld);
        pair_rows(p.data(), rows, s, ld, round_up(s, 16), 16, key_stride, p_pairs.data());
        pair_rows(ds.data(), rows, s, ld, round_up(s, 16), 16, key_stride, ds_pairs.data());
        pair_rows(qh + first * qs.row, rows, e, qs.row, columns, 16 * row_pairs, 16, q_pairs.data());
        pair_rows(gh + first * gs.row, rows, e, gs.row, columns, 16 * row_pairs, 16, g_pairs.data());
        const auto key_rows = [key_stride](const std::vector<uint32_t>& pairs_of) {
          return [&pairs_of, key_stride](int64_t r0) { return std::pair(pairs_of.data() + r0, key_stride); };
        };
        const auto into = [&](std::vector<float>& sums_of, BFloat16* out, int64_t out_row) {
          return [&, out, out_row](int64_t r, int64_t c0, int64_t width, const float* sums) {
            float* acc = sums_of.empty() ? nullptr : sums_of.data() + r * columns + c0;
            gradient_row(sums, width, acc, first_block, last_block, out + r * out_row + c0);
          };
        };
        pair_product(key_rows(p_pairs), g_pairs.data(), row_pairs, s, e, into(dv_sums, dvh, dvs.row));
        pair_product(key_rows(ds_pairs), q_pairs.data(), row_pairs, s, e, into(dk_sums, dkh, dks.row));
        const auto query_rows = [&](int64_t r0) {
          pack_pair_rows(ds.data(), r0, rows, s_pairs, ld, ds_rows.data());
          return std::pair<const uint32_t*, int64_t>(ds_rows.data(), SCORE_ROWS);
        };
        pair_product(query_rows, k_pairs.data(), s_pairs, rows, e, [&](int64_t r, int64_t c0, int64_t width, const float* sums) {
          gradient_row(sums, width, nullptr, true, true, dqh + (first + r) * dqs.row + c0);
        });
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

int64_t hot_attention_backward_compiled() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// attention_backward(), `strides` the batch, head and row strides of q, k, g, v, dq, dk and dv in turn; the
// caller has checked hot_attention_backward_compiled() and that the CPU has AVX512-BF16.
void hot_attention_backward(const void* q, const void* k, const void* g, const void* v, int64_t batch, int64_t heads,
                            int64_t l, int64_t s, int64_t e, const int64_t* strides, const float* lse, const float* delta,
                            float scale, void* dq, void* dk, void* dv) {
#if defined(__AVX512F__)
  attention_backward(static_cast<const BFloat16*>(q), static_cast<const BFloat16*>(k), static_cast<const BFloat16*>(g),
                     static_cast<const BFloat16*>(v), batch, heads, l, s, e, reinterpret_cast<const HeadStrides*>(strides),
                     lse, delta, scale, static_cast<BFloat16*>(dq), static_cast<BFloat16*>(dk), static_cast<BFloat16*>(dv));
#endif
}

}  // extern "C"
