// The engines of cpu_gemm.cpp's integer GEMM, which precedes this file in one translation unit, and
// its exports, with C linkage for hot_compile/runtime/cpu_kernels.py: a block of int32 sums over a
// chunk of the contraction, from A's rows as the engine packs them and B packed by pack_b().

#if defined(__AVX2__)
namespace {

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// Tiles: C in tmm0..3 (a 32 × 32 block of int32), A in tmm4..5 (2 × 16 rows × 64 values), B in
// tmm6..7 (16 rows of 4-value groups × 16 columns each): 4 products per 4 tile loads.
struct AmxTiles {
  static constexpr int64_t rows = 32;
  // Contraction values per chunk: a group's A chunk (256 KiB) and a column block's B chunk (32 KiB)
  // stay in L2 while the chunk's products run.
  static constexpr int64_t chunk = 1024;
  // dpbssd multiplies signed bytes: A is read as it is, in place where its tiles are whole rows.
  static constexpr bool offset_a = false;

  struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };

  static void begin() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
  }
  static void end() { _tile_release(); }

  // One 32 × 32 block of int32 sums over k in [k0, k1): A rows at `a` (stride lda), B's two column
  // blocks packed; the sums start from zero (`first`) or from `c`, and end in `c` (row stride GEMM_N).
  // Tiles are not renamed, so each load comes right before the first product that reads it, and the
  // next step's loads wait only on the products that read their tiles.
  static void product(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1, int64_t k0, int64_t k1,
                      bool first, const int32_t* /*offset_sums*/, int32_t* c) {
    constexpr int64_t ldc = GEMM_N * sizeof(int32_t);
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, c, ldc);
      _tile_loadd(1, c + 16, ldc);
      _tile_loadd(2, c + 16 * GEMM_N, ldc);
      _tile_loadd(3, c + 16 * GEMM_N + 16, ldc);
    }
    for (int64_t k = k0; k < k1; k += GEMM_K) {
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
    _tile_stored(2, c + 16 * GEMM_N, ldc);
    _tile_stored(3, c + 16 * GEMM_N + 16, ldc);
  }
};
#endif

// The register engines': both multiply unsigned by signed bytes, so A is packed as a + 128, and
// neither has state to set up.
struct OffsetRegisters {
  // A tile's rows × 4096 values of A and a column block's 32 × 4096 of B (128 KiB) stream from L2 as its
  // products run. At ViT-S's HLA product [1536 × 6304 × 384] on Zen 4, chunks of 1024 (the AMX
  // engine's) took the VNNI engine 1.13× the time of torch._int_mm's, chunks of 2048 to 4096 1.04–1.10×.
  static constexpr int64_t chunk = 4096;
  static constexpr bool offset_a = true;

  static void begin() {}
  static void end() {}
};

#if defined(__AVX512VNNI__)
// A block of 12 rows × 32 columns in 24 registers: per 4 contraction values, two loads of B and 12
// broadcasts of A feed 24 products.
struct VnniRegisters : OffsetRegisters {
  static constexpr int64_t rows = 12;

  // As AmxTiles::product, on A packed as a + 128; `offset_sums`, where given (the last chunk), holds
  // 128 · Σₖ b[k, n] for the block's columns, which leaves the sums of a · b.
  static void product(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1, int64_t k0, int64_t k1,
                      bool first, const int32_t* offset_sums, int32_t* c) {
    __m512i acc[rows][2];
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r) {
      acc[r][0] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(c + r * GEMM_N);
      acc[r][1] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(c + r * GEMM_N + 16);
    }
    for (int64_t k = k0; k < k1; k += 4) {
      const __m512i v0 = _mm512_loadu_si512(b0 + k * 16), v1 = _mm512_loadu_si512(b1 + k * 16);
#pragma GCC unroll 12
      for (int r = 0; r < rows; ++r) {
        int32_t quad;
        std::memcpy(&quad, a + r * lda + k, sizeof quad);
        const __m512i x = _mm512_set1_epi32(quad);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], x, v0);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], x, v1);
      }
    }
    if (offset_sums != nullptr) {
      const __m512i s0 = _mm512_loadu_si512(offset_sums), s1 = _mm512_loadu_si512(offset_sums + 16);
#pragma GCC unroll 12
      for (int r = 0; r < rows; ++r) {
        acc[r][0] = _mm512_sub_epi32(acc[r][0], s0);
        acc[r][1] = _mm512_sub_epi32(acc[r][1], s1);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r) {
      _mm512_storeu_si512(c + r * GEMM_N, acc[r][0]);
      _mm512_storeu_si512(c + r * GEMM_N + 16, acc[r][1]);
    }
  }
};

#elif defined(__AVX2__)
// Without VNNI: a block of 3 rows × 32 columns in 12 registers. Per 4 contraction values and 8
// columns, vpmaddubsw sums the products of A's unsigned bytes (a + 128, ≤ 255) and B's signed ones in
// adjacent pairs, in int16, which holds them exactly where |b| ≤ 64 (2 · 255 · 64 < 2^15); vpmaddwd
// adds the two pairs into int32: two multiply instructions per 32 products, where float32 takes four FMAs.
struct Avx2Registers : OffsetRegisters {
  static constexpr int64_t rows = 3;

  // As VnniRegisters::product.
  static void product(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1, int64_t k0, int64_t k1,
                      bool first, const int32_t* offset_sums, int32_t* c) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[rows][4];
#pragma GCC unroll 3
    for (int r = 0; r < rows; ++r) {
      for (int q = 0; q < 4; ++q) {
        acc[r][q] = first ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * GEMM_N + 8 * q));
      }
    }
    for (int64_t k = k0; k < k1; k += 4) {
      const __m256i* columns[2] = {reinterpret_cast<const __m256i*>(b0 + k * 16), reinterpret_cast<const __m256i*>(b1 + k * 16)};
#pragma GCC unroll 3
      for (int r = 0; r < rows; ++r) {
        int32_t quad;
        std::memcpy(&quad, a + r * lda + k, sizeof quad);
        const __m256i x = _mm256_set1_epi32(quad);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const __m256i pairs = _mm256_maddubs_epi16(x, _mm256_loadu_si256(columns[q / 2] + q % 2));
          acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < rows; ++r) {
      for (int q = 0; q < 4; ++q) {
        __m256i sums = acc[r][q];
        if (offset_sums != nullptr) sums = _mm256_sub_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset_sums + 8 * q)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * GEMM_N + 8 * q), sums);
      }
    }
  }
};
#endif

// 128 · Σₖ b[k, n] for each column of B packed by pack_b: a product of 128s with each 4-value group
// (on AVX2 its pairs' sums, −32768 to 32512, fit int16).
void offset_column_sums(const int8_t* packed, int64_t kp, int64_t np, int32_t* sums) {
  for (int64_t block = 0; block < np / 16; ++block) {
#if defined(__AVX512VNNI__)
    const __m512i all = _mm512_set1_epi8(int8_t(0x80));
    __m512i acc = _mm512_setzero_si512();
    for (int64_t g = 0; g < kp / 4; ++g) {
      acc = _mm512_dpbusd_epi32(acc, all, _mm512_loadu_si512(packed + (block * kp / 4 + g) * 64));
    }
    _mm512_storeu_si512(sums + block * 16, acc);
#else
    const __m256i all = _mm256_set1_epi8(int8_t(0x80)), ones = _mm256_set1_epi16(1);
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t g = 0; g < kp / 4; ++g) {
      const __m256i* groups = reinterpret_cast<const __m256i*>(packed + (block * kp / 4 + g) * 64);
      for (int h = 0; h < 2; ++h) {
        acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_maddubs_epi16(all, _mm256_loadu_si256(groups + h)), ones));
      }
    }
    for (int h = 0; h < 2; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + block * 16 + 8 * h), acc[h]);
#endif
  }
}

}  // namespace
#endif

// Engines, as hot_compile/runtime/cpu_kernels.py numbers them.
enum : int64_t { GEMM_VNNI = 1, GEMM_AMX = 2, GEMM_AVX2 = 4 };

extern "C" {

// The engines this build has, a mask of GEMM_VNNI, GEMM_AMX and GEMM_AVX2.
int64_t hot_gemm_engines() {
  int64_t engines = 0;
#if defined(__AVX512VNNI__)
  engines |= GEMM_VNNI;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  engines |= GEMM_AMX;
#endif
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
  engines |= GEMM_AVX2;
#endif
  return engines;
}

// out[m, n] = (a @ b)[m, n] · row_scale[m] · col_scale[n] / divisor (+ bias[n]), a: int8 [m, k] (strides
// sam, sak), b: int8 [k, n] (strides sbk, sbn), on `engine`. The caller has checked hot_gemm_engines(),
// and for AMX enabled it for the process.
void hot_matmul_dequantize(const int8_t* a, int64_t m, int64_t k, int64_t sam, int64_t sak, const int8_t* b, int64_t n,
                           int64_t sbk, int64_t sbn, const float* row_scale, int64_t row_scale_stride,
                           const float* col_scale, int64_t col_scale_stride, float divisor, const float* bias,
                           void* out, int64_t out_dtype, int64_t engine) {
#if defined(__AVX2__)
  const int64_t kp = (k + GEMM_K - 1) / GEMM_K * GEMM_K, np = (n + GEMM_N - 1) / GEMM_N * GEMM_N;
  // Not zero-filled first (on one thread, while the others wait): pack_b writes every entry.
  const std::unique_ptr<int8_t[]> packed(new int8_t[kp * np]);
  pack_b(b, k, n, sbk, sbn, kp, np, packed.get());
  auto run = [&](auto engine_tag, auto* o) {
    using Engine = decltype(engine_tag);
    std::vector<int32_t> offset_sums(Engine::offset_a ? np : 0);
    if constexpr (Engine::offset_a) offset_column_sums(packed.get(), kp, np, offset_sums.data());
    matmul_dequantize<Engine>(a, m, k, sam, sak, packed.get(), n, kp, Engine::offset_a ? offset_sums.data() : nullptr,
                              row_scale, row_scale_stride, col_scale, col_scale_stride, divisor, bias, o);
  };
  auto by_out = [&](auto engine_tag) {
    switch (out_dtype) {
      case FLOAT32: return run(engine_tag, static_cast<float*>(out));
      case BFLOAT16: return run(engine_tag, static_cast<BFloat16*>(out));
      default: return run(engine_tag, static_cast<_Float16*>(out));
    }
  };
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  if (engine == GEMM_AMX) return by_out(AmxTiles{});
#endif
#if defined(__AVX512VNNI__)
  if (engine == GEMM_VNNI) return by_out(VnniRegisters{});
#elif defined(__AVX2__)
  if (engine == GEMM_AVX2) return by_out(Avx2Registers{});
#endif
#endif
}

}  // extern "C"
