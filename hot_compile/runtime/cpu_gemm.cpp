// HOT's integer GEMM with the dequantizing epilogue of cpu_kernels.cpp fused in, on the primitives of
// cpu_primitives.cpp, which precedes this file in one translation unit: the packing, the blocking and
// the epilogue. Its engines and exports follow in cpu_gemm_engines.cpp.
//
// torch._int_mm writes an int32 product that a second pass then scales into the output: at the MLP
// block's [6272, 768] × [768, 3072] that round trip took a third of the product's time on Zen 4. And
// on AMX it runs oneDNN's gemm API on AVX512-VNNI, at about the rate of an AMX bf16 product. These
// kernels take int8 operands of any strides and write the scaled output: the int32 sums stay in
// registers or tiles, or, for a contraction longer than one chunk, in a panel of them that stays in L2.
// Three engines share them:
// * AMX tiles, where Inductor's vector ISA enables them (-mamx-tile -mamx-int8);
// * AVX512-VNNI registers (-mavx512vnni). Its product multiplies unsigned by signed bytes, so A is
//   packed as a + 128 and 128 · Σₖ b[k, n] is taken off each column's sums;
// * AVX2 registers, on CPUs without VNNI, with A packed the same way: exact where |b| ≤ 64 (its
//   products' pairs are summed in int16).
// hot_gemm_engines() says which were compiled.

#if defined(__AVX2__)

namespace {

// Columns of an output block (two 16-column blocks of packed B), and the contraction's padding (a row
// of an AMX tile).
constexpr int64_t GEMM_N = 32, GEMM_K = 64;
// Rows of A a thread takes at a time (at most; fewer where that shares them out evenly).
constexpr int64_t GEMM_GROUP = 256;
// Columns per panel: a group's int32 sums over the panel (256 KiB) stay in L2 between chunks.
constexpr int64_t GEMM_NP = 256;
constexpr int64_t GEMM_STREAM_BYTES = 8 << 20;

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

// `count` rows of A from `first` (strides sm, sk), zero-padded to kp columns and to a whole `tile` rows;
// with `offset`, each value as the uint8 a + 128: its sign bit flipped, which adds 128 modulo 256 (B is
// zero along the padding, whatever A holds there).
void pack_a(const int8_t* a, int64_t first, int64_t count, int64_t k, int64_t sm, int64_t sk, int64_t kp,
            int64_t tile, bool offset, int8_t* packed) {
  const int64_t rows = (count + tile - 1) / tile * tile;
  const int8_t flip = offset ? int8_t(0x80) : 0;
  if (sk == 1) {
    const __m256i bits = _mm256_set1_epi8(flip);
    for (int64_t r = 0; r < count; ++r) {
      const int8_t* row = a + (first + r) * sm;
      int8_t* out = packed + r * kp;
      int64_t c = 0;
      for (; c + 32 <= k; c += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm256_xor_si256(v, bits));
      }
      for (; c < k; ++c) out[c] = row[c] ^ flip;
      std::memset(out + k, 0, kp - k);
    }
  } else {
    // A transposed operand (HLA's q(P g)ᵀ): blocks of 32 rows × 16 where its rows are contiguous in memory.
    const int64_t r32 = sm == 1 ? count / 32 * 32 : 0, c16 = sm == 1 ? k / 16 * 16 : 0;
    // Along k outermost: 16 source rows are read whole while the panel's lines they fill stay in L1.
    for (int64_t c = 0; c < c16; c += 16) {
      for (int64_t r = 0; r < r32; r += 32) {
        transpose16x32(a + (first + r) * sm + c * sk, sk, packed + r * kp + c, kp, flip);
      }
    }
    for (int64_t c = 0; c < k; ++c) {
      const int8_t* column = a + first * sm + c * sk;
      for (int64_t r = c < c16 ? r32 : 0; r < count; ++r) packed[r * kp + c] = column[r * sm] ^ flip;
    }
    for (int64_t r = 0; r < count; ++r) std::memset(packed + r * kp + k, 0, kp - k);
  }
  std::memset(packed + count * kp, 0, (rows - count) * kp);
}

// dequantize_row() of cpu_kernels.cpp on one block: rows × cols of c (stride GEMM_N) into out (stride ldo),
// a whole row of the block through a line-aligned buffer, so that it can be streamed.
template <typename Out>
inline void block_epilogue(const int32_t* c, int64_t rows, int64_t cols, const float* row_scale, int64_t row_scale_stride,
                           const float* column, const float* bias, Out* out, int64_t ldo, bool stream) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = row_scale[r * row_scale_stride];
    const int32_t* a = c + r * GEMM_N;
    Out* o = out + r * ldo;
    if (cols == GEMM_N) {
      alignas(64) Out values[GEMM_N];
      dequantize_row(a, GEMM_N, s, column, bias, values);
      if (stream && (reinterpret_cast<uintptr_t>(o) & 63) == 0) {
        for (size_t half = 0; half < sizeof values / 32; ++half) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(o) + half, _mm256_load_si256(reinterpret_cast<const __m256i*>(values) + half));
        }
      } else {
        std::memcpy(o, values, sizeof values);
      }
      continue;
    }
    dequantize_row(a, cols, s, column, bias, o);
  }
}

template <typename Engine, typename Out>
void matmul_dequantize(const int8_t* a, int64_t m, int64_t k, int64_t sam, int64_t sak, const int8_t* packed_b,
                       int64_t n, int64_t kp, const int32_t* offset_sums, const float* row_scale,
                       int64_t row_scale_stride, const float* col_scale, int64_t col_scale_stride, float divisor,
                       const float* bias, Out* out) {
  constexpr int64_t tile = Engine::rows;
  // Groups of whole tiles, as many as a multiple of the threads, that differ by at most one tile: M = 768
  // in 3 groups of 256 would leave one of 2 threads idle a third of the time, and M = 6304 in 26 groups
  // of 252 rows (the last of 4) one thread a thirteenth.
  const int64_t threads = omp_get_max_threads();
  const int64_t rounds = (m + threads * GEMM_GROUP - 1) / (threads * GEMM_GROUP);
  const int64_t tiles = (m + tile - 1) / tile;
  const int64_t groups = std::min(tiles, threads * rounds);
  const int64_t group = (tiles + groups - 1) / groups * tile;  // rows of the largest group
  // A read in place where its tiles are whole rows of 64 values as the engine takes them; else each
  // group is copied, padded.
  const bool direct = !Engine::offset_a && sak == 1 && k == kp;
  // An output larger than the caches goes around them: a store that allocates its line reads it first.
  const bool stream = m * n * int64_t(sizeof(Out)) > GEMM_STREAM_BYTES;
#pragma omp parallel
  {
    Engine::begin();
    std::vector<float> column(n);
    for (int64_t j = 0; j < n; ++j) column[j] = col_scale[j * col_scale_stride] / divisor;
    std::vector<int8_t> panel((direct ? tile : group) * kp);  // in place, the last rows short of a tile
    // A panel's int32 sums between chunks of the contraction, where it has more than one.
    std::vector<int32_t> sums(kp > Engine::chunk ? group * GEMM_NP : 0);
    alignas(64) int32_t c[tile * GEMM_N];
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = g * tiles / groups * tile, count = std::min(m, (g + 1) * tiles / groups * tile) - first;
      const int64_t whole = direct ? count / tile * tile : 0;
      if (whole < count) {
        pack_a(a, first + whole, count - whole, k, sam, sak, kp, tile, Engine::offset_a, panel.data());
      }
      // For each panel of GEMM_NP columns and chunk of the contraction, B's chunk of a
      // column block is read from cache by each of the group's row blocks in turn, and the panel's
      // sums stay in L2.
      for (int64_t jp = 0; jp < n; jp += GEMM_NP) {
        for (int64_t k0 = 0; k0 < kp; k0 += Engine::chunk) {
          const int64_t k1 = std::min(kp, k0 + Engine::chunk);
          for (int64_t j0 = jp; j0 < std::min(n, jp + GEMM_NP); j0 += GEMM_N) {
            const int8_t* b0 = packed_b + (j0 / 16) * kp * 16;
            const int8_t* b1 = b0 + kp * 16;
            const int64_t cols = std::min(GEMM_N, n - j0);
            const int32_t* block_offsets = offset_sums != nullptr && k1 == kp ? offset_sums + j0 : nullptr;
            for (int64_t r0 = 0; r0 < count; r0 += tile) {
              const bool in_place = r0 < whole;
              const int8_t* rows_a = in_place ? a + (first + r0) * sam : panel.data() + (r0 - whole) * kp;
              int32_t* partial = sums.data() + (r0 * GEMM_NP + (j0 - jp) * tile);
              if (k0 > 0 && k1 == kp) std::memcpy(c, partial, sizeof c);
              Engine::product(rows_a, in_place ? sam : kp, b0, b1, k0, k1, k0 == 0, block_offsets, k1 == kp ? c : partial);
              if (k1 < kp) continue;
              const int64_t row = first + r0;
              block_epilogue(c, std::min(tile, count - r0), cols, row_scale + row * row_scale_stride, row_scale_stride,
                             column.data() + j0, bias == nullptr ? nullptr : bias + j0, out + row * n + j0, n, stream);
            }
          }
        }
      }
    }
    if (stream) _mm_sfence();  // this thread's streamed lines, before the region's barrier
    Engine::end();
  }
}

}  // namespace
#endif
