// The bf16 attention backward as one native kernel (hot_compile/runtime/attention_ops.py), where the CPU
// has AVX512-BF16: a block of a head's queries at a time on a thread, its score products fused with the
// elementwise pass of cpu_attention.cpp, which precedes this file in one translation unit with the
// primitives of cpu_primitives.cpp, then the three gradient products on its pair products; exported with C
// linkage for hot_compile/runtime/cpu_kernels.py.

namespace {

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
      const __mmask16 lanes = c + 16 <= cols ? __mmask16(0xFFFF) : c < cols ? __mmask16((1u << (cols - c)) - 1) : 0;
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, even + c));
      const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, even + row_stride + c))
                             : _mm512_setzero_si512();
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
    if (last) {
      store_lanes(v, width - c, out + c);
    } else {
      store16(v, acc + c);
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
      const int64_t width = std::min(SCORE_COLS, cols - c0);
      for (int64_t r = 0; r < std::min(SCORE_ROWS, rows - r0); ++r) emit(r0 + r, c0, width, sums[r]);
    }
  }
}

// Query rows of a head a thread takes at a time, at most: the block's P and dS and their pairs (8 bytes a score)
// within its caches. A head of ViT-S or MiniLM is one block.
constexpr int64_t QUERY_BLOCK_BYTES = 1 << 20;

// The query blocks of `heads` heads of `blocks` blocks each, shared out among `threads` in contiguous runs that differ
// by at most one block: a head whose blocks two threads share ("split") has its dK and dV summed by each over its
// blocks, kept in float32, then added in block order after both.
struct BlockRuns {
  int64_t heads, blocks, threads;
  int64_t begin(int64_t t) const { return t * heads * blocks / threads; }
  int64_t thread_of(int64_t item) const {  // the thread whose run holds `item`
    int64_t t = item * threads / (heads * blocks);
    while (begin(t + 1) <= item) ++t;
    while (begin(t) > item) --t;
    return t;
  }
  // The heads whose blocks two threads or more share, in order.
  std::vector<int64_t> split_heads() const {
    std::vector<int64_t> split;
    for (int64_t t = 1; t < threads; ++t) {
      const int64_t h = begin(t) / blocks;
      if (begin(t) % blocks != 0 && (split.empty() || split.back() != h)) split.push_back(h);
    }
    return split;
  }
  // A thread's partial sums of a split head: the first slot for the first head of its run, the second for its last.
  int64_t slot(int64_t t, int64_t h) const { return 2 * t + (h == begin(t) / blocks ? 0 : 1); }
};

// dQ, dK and dV of `batch` × `heads` heads, their queries in blocks: each block's P and dS (head_scores), then
//   dV = Pᵀ dO,   dK = dSᵀ Q,   dQ = dS K
// on vdpbf16ps from operands interleaved by pairs along the contraction, while P and dS stay in the thread's
// caches. dQ's rows of a block are whole; dK and dV sum over the blocks in float32, rounded once after the last.
// strides: q, k, g, v, dq, dk, dv's.
void attention_backward(const BFloat16* q, const BFloat16* k, const BFloat16* g, const BFloat16* v, int64_t batch,
                        int64_t heads, int64_t l, int64_t s, int64_t e, const HeadStrides* strides, const float* lse,
                        const float* delta, float scale, BFloat16* dq, BFloat16* dk, BFloat16* dv) {
  const HeadStrides &qs = strides[0], &ks = strides[1], &gs = strides[2], &vs = strides[3];
  const HeadStrides &dqs = strides[4], &dks = strides[5], &dvs = strides[6];
  const auto round_up = [](int64_t x, int64_t to) { return (x + to - 1) / to * to; };
  const int64_t count = batch * heads, pairs = e / 2, s_pairs = (s + 1) / 2;
  if (count == 0 || l == 0 || s == 0) return;  // attention_ops.py runs none of these here
  const int64_t ld = round_up(s, SCORE_COLS), columns = round_up(e, SCORE_COLS), sums_size = s * columns;
  // Blocks within the caches, and, where there are fewer heads than threads, at least two per thread.
  const int64_t threads = omp_get_max_threads(), per_head = (2 * threads + count - 1) / count;
  const int64_t cached = std::max<int64_t>(1, QUERY_BLOCK_BYTES / (8 * ld * SCORE_ROWS)) * SCORE_ROWS;
  const int64_t block = std::min(cached, round_up((l + per_head - 1) / per_head, SCORE_ROWS));
  const int64_t blocks = (l + block - 1) / block, block_pairs = block / 2;  // SCORE_ROWS is even
  // The broadcast rows of Pᵀ and dSᵀ: a whole tile of SCORE_ROWS past any key row.
  const int64_t key_stride = ld + 16;
  std::vector<std::vector<float>> partial(2 * threads);  // [slot]: a split head's dK then dV sums
#pragma omp parallel
  {
    const BlockRuns runs{count, blocks, omp_get_num_threads()};
    const int64_t t = omp_get_thread_num();
    std::vector<uint32_t> keys(ld * pairs), values(ld * pairs), q_rows(pairs * SCORE_ROWS), g_rows(pairs * SCORE_ROWS);
    // Zero past column s: dQ's pairs of dS reach column s where s is odd.
    std::vector<BFloat16> p(block * ld), ds(block * ld);
    std::vector<uint32_t> p_pairs(block_pairs * key_stride), ds_pairs(block_pairs * key_stride);
    std::vector<uint32_t> ds_rows(s_pairs * SCORE_ROWS);
    std::vector<uint32_t> q_pairs(columns * block_pairs), g_pairs(columns * block_pairs), k_pairs(columns * s_pairs);
    std::vector<float> head_sums(blocks > 1 ? 2 * sums_size : 0);
    for (int64_t item = runs.begin(t), end = runs.begin(t + 1); item < end;) {
      const int64_t h = item / blocks, b0 = item % blocks, b1 = std::min(blocks, b0 + end - item);
      item += b1 - b0;
      const BFloat16 *qh = qs.at(q, h, heads), *kh = ks.at(k, h, heads), *gh = gs.at(g, h, heads), *vh = vs.at(v, h, heads);
      BFloat16 *dqh = dqs.at(dq, h, heads), *dkh = dks.at(dk, h, heads), *dvh = dvs.at(dv, h, heads);
      const bool split = b0 > 0 || b1 < blocks;
      std::vector<float>& sums_of = split ? partial[runs.slot(t, h)] : head_sums;
      if (split) sums_of.resize(2 * sums_size);
      pack_pair_columns(kh, s, pairs, ks.row, keys.data());
      pack_pair_columns(vh, s, pairs, vs.row, values.data());
      pair_rows(kh, s, e, ks.row, columns, 16 * s_pairs, 16, k_pairs.data());
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t first = b * block, rows = std::min(block, l - first), row_pairs = (rows + 1) / 2;
        const bool first_block = b == b0, last_block = !split && b + 1 == blocks;
        head_scores(qh + first * qs.row, qs.row, gh + first * gs.row, gs.row, keys.data(), values.data(), rows, s,
                    pairs, lse + h * l + first, delta + h * l + first, scale, q_rows.data(), g_rows.data(), p.data(),
                    ds.data(), ld);
        pair_rows(p.data(), rows, s, ld, round_up(s, 16), 16, key_stride, p_pairs.data());
        pair_rows(ds.data(), rows, s, ld, round_up(s, 16), 16, key_stride, ds_pairs.data());
        pair_rows(qh + first * qs.row, rows, e, qs.row, columns, 16 * row_pairs, 16, q_pairs.data());
        pair_rows(gh + first * gs.row, rows, e, gs.row, columns, 16 * row_pairs, 16, g_pairs.data());
        const auto key_rows = [key_stride](const std::vector<uint32_t>& pairs_of) {
          return [&pairs_of, key_stride](int64_t r0) { return std::pair(pairs_of.data() + r0, key_stride); };
        };
        const auto into = [&](int64_t which, BFloat16* out, int64_t out_row) {
          return [&, which, out, out_row](int64_t r, int64_t c0, int64_t width, const float* sums) {
            float* acc = sums_of.empty() ? nullptr : sums_of.data() + which * sums_size + r * columns + c0;
            gradient_row(sums, width, acc, first_block, last_block, out + r * out_row + c0);
          };
        };
        pair_product(key_rows(ds_pairs), q_pairs.data(), row_pairs, s, e, into(0, dkh, dks.row));
        pair_product(key_rows(p_pairs), g_pairs.data(), row_pairs, s, e, into(1, dvh, dvs.row));
        const auto query_rows = [&](int64_t r0) {
          pack_pair_rows(ds.data(), r0, rows, s_pairs, ld, ds_rows.data());
          return std::pair<const uint32_t*, int64_t>(ds_rows.data(), SCORE_ROWS);
        };
        const auto query_grad = [&](int64_t r, int64_t c0, int64_t width, const float* sums) {
          gradient_row(sums, width, nullptr, true, true, dqh + (first + r) * dqs.row + c0);
        };
        pair_product(query_rows, k_pairs.data(), s_pairs, rows, e, query_grad);
      }
    }
    // The split heads' dK and dV: each thread's sums in turn, rounded once.
    const std::vector<int64_t> split = runs.split_heads();
#pragma omp barrier
#pragma omp for collapse(2) schedule(static)
    for (size_t i = 0; i < split.size(); ++i) {
      for (int64_t r = 0; r < s; ++r) {
        const int64_t h = split[i], last = runs.thread_of((h + 1) * blocks - 1);
        for (int64_t which = 0; which < 2; ++which) {
          BFloat16* out = which == 0 ? dks.at(dk, h, heads) + r * dks.row : dvs.at(dv, h, heads) + r * dvs.row;
          for (int64_t c = 0; c < e; c += 16) {
            Float16x sum = {};
            for (int64_t u = runs.thread_of(h * blocks); u <= last; ++u) {
              sum += load16(partial[runs.slot(u, h)].data() + which * sums_size + r * columns + c);
            }
            store_lanes(sum, e - c, out + c);
          }
        }
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

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
