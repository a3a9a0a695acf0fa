// HOT's integer GEMM on AMX tiles with the dequantizing epilogue of cpu_kernels.cpp fused in, on the
// primitives of cpu_primitives.cpp, which precedes this file in one translation unit; exported with C
// linkage for hot_compile/runtime/cpu_kernels.py.
//
// torch._int_mm runs oneDNN's gemm API on AVX512-VNNI even where the CPU has AMX, at about the rate of
// an AMX bf16 product, so that an int8 product gained nothing over bf16 there. This kernel takes int8
// operands of any strides and writes the scaled output: the int32 sums stay in tiles, or, for a
// contraction longer than one chunk, in a panel of them that stays in L2.
// Compiled only where Inductor's vector ISA enables AMX (-mamx-tile -mamx-int8); hot_amx_compiled()
// says whether it was.

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <immintrin.h>

namespace {

// Tiles: C in tmm0..3 (a 32 × 32 block of int32), A in tmm4..5 (2 × 16 rows × 64 values), B in
// tmm6..7 (16 rows of 4-value groups × 16 columns each): 4 products per 4 tile loads.
constexpr int64_t AMX_M = 32, AMX_N = 32, AMX_K = 64;
// Rows of A a thread takes at a time (at most; fewer where that shares them out evenly).
constexpr int64_t AMX_GROUP = 256;
// Contraction values per chunk: a group's A chunk (256 KiB) and a column block's B chunk (32 KiB)
// stay in L2 while the chunk's products run.
constexpr int64_t AMX_KC = 1024;
// Columns per panel: a group's int32 sums over the panel (256 KiB) stay in L2 between chunks.
constexpr int64_t AMX_NP = 256;
constexpr int64_t AMX_STREAM_BYTES = 8 << 20;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// B [k, n] (strides sk, sn) in AMX's VNNI layout, zero-padded to [kp, np]: for each block of 16 columns,
// kp/4 rows of 16 groups of 4 consecutive k, so that a tile of B is 1 KiB read at a stride of 64 bytes.
void pack_b(const int8_t* b, int64_t k, int64_t n, int64_t sk, int64_t sn, int64_t kp, int64_t np, int8_t* packed) {
  const int64_t k4 = k / 4 * 4, n16 = n / 16 * 16;
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < np / 16; ++block) {
    int8_t* out = packed + block * kp * 16;
    const int64_t col0 = block * 16;
    const bool whole = col0 < n16;
    int64_t g = 0;
    if (whole && sn == 1) {
      // Rows of B in memory: four rows' 16 bytes interleaved by bytes, then by pairs.
      for (; 4 * g < k4; ++g) {
        const int8_t* row = b + 4 * g * sk + col0;
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + sk));
        const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * sk));
        const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 3 * sk));
        const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
        const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
        __m128i* dst = reinterpret_cast<__m128i*>(out + g * 64);
        _mm_storeu_si128(dst, _mm_unpacklo_epi16(lo01, lo23));
        _mm_storeu_si128(dst + 1, _mm_unpackhi_epi16(lo01, lo23));
        _mm_storeu_si128(dst + 2, _mm_unpacklo_epi16(hi01, hi23));
        _mm_storeu_si128(dst + 3, _mm_unpackhi_epi16(hi01, hi23));
      }
    } else if (whole && sk == 1) {
      // Columns of B in memory (a weight's q(W)ᵀ): each group of 4 is 4 consecutive bytes of a column.
      for (; 4 * g < k4; ++g) {
        for (int64_t j = 0; j < 16; ++j) std::memcpy(out + (g * 16 + j) * 4, b + 4 * g + (col0 + j) * sn, 4);
      }
    }
    for (; g < kp / 4; ++g) {
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t col = col0 + j;
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t row = 4 * g + i;
          out[(g * 16 + j) * 4 + i] = row < k && col < n ? b[row * sk + col * sn] : 0;
        }
      }
    }
  }
}

// dst[i][j] = src[j][i] for a 16 × 16 block of bytes (rows `src_stride` and `dst_stride` apart), in four
// rounds of interleaving pairs of registers: bytes, then pairs, quads and eights of them. Register
// h·8 + p of a round holds the low (h = 0) or high (h = 1) half of the interleave of the round
// before's registers 2p and 2p + 1, so after the fourth, register j holds source column j, rows in order.
inline void transpose16(const int8_t* src, int64_t src_stride, int8_t* dst, int64_t dst_stride) {
  __m128i x[16], y[16];
  for (int i = 0; i < 16; ++i) x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  for (int p = 0; p < 8; ++p) {
    y[p] = _mm_unpacklo_epi8(x[2 * p], x[2 * p + 1]);
    y[8 + p] = _mm_unpackhi_epi8(x[2 * p], x[2 * p + 1]);
  }
  for (int g = 0; g < 2; ++g) {
    for (int p = 0; p < 4; ++p) {
      x[8 * g + p] = _mm_unpacklo_epi16(y[8 * g + 2 * p], y[8 * g + 2 * p + 1]);
      x[8 * g + 4 + p] = _mm_unpackhi_epi16(y[8 * g + 2 * p], y[8 * g + 2 * p + 1]);
    }
  }
  for (int g = 0; g < 4; ++g) {
    for (int p = 0; p < 2; ++p) {
      y[4 * g + p] = _mm_unpacklo_epi32(x[4 * g + 2 * p], x[4 * g + 2 * p + 1]);
      y[4 * g + 2 + p] = _mm_unpackhi_epi32(x[4 * g + 2 * p], x[4 * g + 2 * p + 1]);
    }
  }
  for (int g = 0; g < 8; ++g) {
    x[2 * g] = _mm_unpacklo_epi64(y[2 * g], y[2 * g + 1]);
    x[2 * g + 1] = _mm_unpackhi_epi64(y[2 * g], y[2 * g + 1]);
  }
  for (int j = 0; j < 16; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * dst_stride), x[j]);
}

// `count` rows of A from `first` (strides sm, sk), zero-padded to kp columns and to a whole 32 rows.
void pack_a(const int8_t* a, int64_t first, int64_t count, int64_t k, int64_t sm, int64_t sk, int64_t kp,
            int8_t* packed) {
  const int64_t rows = (count + AMX_M - 1) / AMX_M * AMX_M;
  if (sk == 1) {
    for (int64_t r = 0; r < count; ++r) {
      std::memcpy(packed + r * kp, a + (first + r) * sm, k);
      std::memset(packed + r * kp + k, 0, kp - k);
    }
  } else {
    // A transposed operand (HLA's q(P g)ᵀ): blocks of 16 × 16 where its rows are contiguous in memory.
    const int64_t r16 = sm == 1 ? count / 16 * 16 : 0, c16 = sm == 1 ? k / 16 * 16 : 0;
    // Along k outermost: 16 source rows are read whole while the panel's lines they fill stay in L1.
    for (int64_t c = 0; c < c16; c += 16) {
      for (int64_t r = 0; r < r16; r += 16) transpose16(a + (first + r) * sm + c * sk, sk, packed + r * kp + c, kp);
    }
    for (int64_t c = 0; c < k; ++c) {
      const int8_t* column = a + first * sm + c * sk;
      for (int64_t r = c < c16 ? r16 : 0; r < count; ++r) packed[r * kp + c] = column[r * sm];
    }
    for (int64_t r = 0; r < count; ++r) std::memset(packed + r * kp + k, 0, kp - k);
  }
  std::memset(packed + count * kp, 0, (rows - count) * kp);
}

// One 32 × 32 block of int32 sums over k in [k0, k1): A rows at `a` (stride lda), B's two column
// blocks packed; the sums start from zero (`first`) or from `c`, and end in `c` (row stride AMX_N).
// Tiles are not renamed, so each load comes right before the first product that reads it, and the
// next step's loads wait only on the products that read their tiles.
inline void block_product(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1, int64_t k0, int64_t k1,
                          bool first, int32_t* c) {
  constexpr int64_t ldc = AMX_N * sizeof(int32_t);
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, ldc);
    _tile_loadd(1, c + 16, ldc);
    _tile_loadd(2, c + 16 * AMX_N, ldc);
    _tile_loadd(3, c + 16 * AMX_N + 16, ldc);
  }
  for (int64_t k = k0; k < k1; k += AMX_K) {
    _tile_loadd(4, a + k, lda);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_loadd(7, b1 + k * 16, 64);
    _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + k, lda);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
  _tile_stored(2, c + 16 * AMX_N, ldc);
  _tile_stored(3, c + 16 * AMX_N + 16, ldc);
}

// dequantize_row() of cpu_kernels.cpp on one block: rows × cols of c (stride AMX_N) into out (stride ldo),
// a whole row of the block through a line-aligned buffer, so that it can be streamed.
template <typename Out>
inline void block_epilogue(const int32_t* c, int64_t rows, int64_t cols, const float* row_scale, int64_t row_scale_stride,
                           const float* column, const float* bias, Out* out, int64_t ldo, bool stream) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = row_scale[r * row_scale_stride];
    const int32_t* a = c + r * AMX_N;
    Out* o = out + r * ldo;
    if (cols == AMX_N) {
      alignas(64) Out values[AMX_N];
      dequantize_row(a, AMX_N, s, column, bias, values);
      if (stream && (reinterpret_cast<uintptr_t>(o) & 63) == 0) {
        for (size_t line = 0; line < sizeof values / 64; ++line) {
          _mm512_stream_si512(reinterpret_cast<__m512i*>(o) + line, _mm512_load_si512(reinterpret_cast<const __m512i*>(values) + line));
        }
      } else {
        std::memcpy(o, values, sizeof values);
      }
      continue;
    }
    dequantize_row(a, cols, s, column, bias, o);
  }
}

template <typename Out>
void amx_matmul_dequantize(const int8_t* a, int64_t m, int64_t k, int64_t sam, int64_t sak, const int8_t* packed_b,
                           int64_t n, int64_t kp, const float* row_scale, int64_t row_scale_stride,
                           const float* col_scale, int64_t col_scale_stride, float divisor, const float* bias,
                           Out* out) {
  // As many groups of whole tiles as a multiple of the threads: M = 768 in 3 groups of 256 would leave
  // one of 2 threads idle a third of the time.
  const int64_t threads = omp_get_max_threads();
  const int64_t rounds = (m + threads * AMX_GROUP - 1) / (threads * AMX_GROUP);
  const int64_t share = (m + threads * rounds - 1) / (threads * rounds);
  const int64_t group = (share + AMX_M - 1) / AMX_M * AMX_M;
  const int64_t groups = (m + group - 1) / group;
  // A read in place where its tiles are whole rows of 64 values; else each group is copied, padded.
  const bool direct = sak == 1 && k == kp;
  // An output larger than the caches goes around them: a store that allocates its line reads it first.
  const bool stream = m * n * int64_t(sizeof(Out)) > AMX_STREAM_BYTES;
#pragma omp parallel
  {
    configure_tiles();
    std::vector<float> column(n);
    for (int64_t j = 0; j < n; ++j) column[j] = col_scale[j * col_scale_stride] / divisor;
    std::vector<int8_t> panel((direct ? AMX_M : group) * kp);  // in place, the last rows short of 32
    // A panel's int32 sums between chunks of the contraction, where it has more than one.
    std::vector<int32_t> sums(kp > AMX_KC ? group * AMX_NP : 0);
    alignas(64) int32_t c[AMX_M * AMX_N];
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = g * group, count = std::min(group, m - first);
      const int64_t whole = direct ? count / AMX_M * AMX_M : 0;
      if (whole < count) {
        pack_a(a, first + whole, count - whole, k, sam, sak, kp, panel.data());
      }
      // For each panel of AMX_NP columns and chunk of AMX_KC contraction values, B's chunk of a column
      // block is read from cache by each of the group's row blocks in turn, and the panel's sums stay in L2.
      for (int64_t jp = 0; jp < n; jp += AMX_NP) {
        for (int64_t k0 = 0; k0 < kp; k0 += AMX_KC) {
          const int64_t k1 = std::min(kp, k0 + AMX_KC);
          for (int64_t j0 = jp; j0 < std::min(n, jp + AMX_NP); j0 += AMX_N) {
            const int8_t* b0 = packed_b + (j0 / 16) * kp * 16;
            const int8_t* b1 = b0 + kp * 16;
            const int64_t cols = std::min(AMX_N, n - j0);
            for (int64_t r0 = 0; r0 < count; r0 += AMX_M) {
              const bool in_place = r0 < whole;
              const int8_t* rows_a = in_place ? a + (first + r0) * sam : panel.data() + (r0 - whole) * kp;
              int32_t* partial = sums.data() + (r0 * AMX_NP + (j0 - jp) * AMX_M);
              if (k0 > 0 && k1 == kp) std::memcpy(c, partial, sizeof c);
              block_product(rows_a, in_place ? sam : kp, b0, b1, k0, k1, k0 == 0, k1 == kp ? c : partial);
              if (k1 < kp) continue;
              const int64_t row = first + r0;
              block_epilogue(c, std::min(AMX_M, count - r0), cols, row_scale + row * row_scale_stride, row_scale_stride,
                             column.data() + j0, bias == nullptr ? nullptr : bias + j0, out + row * n + j0, n, stream);
            }
          }
        }
      }
    }
    if (stream) _mm_sfence();  // this thread's streamed lines, before the region's barrier
    _tile_release();
  }
}

}  // namespace
#endif

extern "C" {

int64_t hot_amx_compiled() {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  return 1;
#else
  return 0;
#endif
}

// out[m, n] = (a @ b)[m, n] · row_scale[m] · col_scale[n] / divisor (+ bias[n]), a: int8 [m, k] (strides
// sam, sak), b: int8 [k, n] (strides sbk, sbn). The caller has enabled AMX for the process and checked
// hot_amx_compiled().
void hot_amx_matmul_dequantize(const int8_t* a, int64_t m, int64_t k, int64_t sam, int64_t sak, const int8_t* b,
                               int64_t n, int64_t sbk, int64_t sbn, const float* row_scale, int64_t row_scale_stride,
                               const float* col_scale, int64_t col_scale_stride, float divisor, const float* bias,
                               void* out, int64_t out_dtype) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  const int64_t kp = (k + AMX_K - 1) / AMX_K * AMX_K, np = (n + AMX_N - 1) / AMX_N * AMX_N;
  std::vector<int8_t> packed(kp * np);
  pack_b(b, k, n, sbk, sbn, kp, np, packed.data());
  auto run = [&](auto* o) {
    amx_matmul_dequantize(a, m, k, sam, sak, packed.data(), n, kp, row_scale, row_scale_stride, col_scale,
                          col_scale_stride, divisor, bias, o);
  };
  switch (out_dtype) {
    case FLOAT32: return run(static_cast<float*>(out));
    case BFLOAT16: return run(static_cast<BFloat16*>(out));
    default: return run(static_cast<_Float16*>(out));
  }
#endif
}

}  // extern "C"
