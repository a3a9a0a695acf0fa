// HOT's integer GEMM on AMX tiles with the dequantizing epilogue of cpu_kernels.cpp fused in, on the
// primitives of cpu_primitives.cpp, which precedes this file in one translation unit; exported with C
// linkage for hot_compile/runtime/cpu_kernels.py.
//
// torch._int_mm runs oneDNN's gemm API on AVX512-VNNI even where the CPU has AMX, at about the rate of
// an AMX bf16 product, so that an int8 product gained nothing over bf16 there. This kernel takes int8
// operands of any strides and writes the scaled output: no int32 product is ever written to memory.
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
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < np / 16; ++block) {
    int8_t* out = packed + block * kp * 16;
    for (int64_t g = 0; g < kp / 4; ++g) {
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t col = block * 16 + j;
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t row = 4 * g + i;
          out[(g * 16 + j) * 4 + i] = row < k && col < n ? b[row * sk + col * sn] : 0;
        }
      }
    }
  }
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
    // Along k outermost: a transposed operand (HLA's q(P g)ᵀ) is read along its rows.
    for (int64_t c = 0; c < k; ++c) {
      const int8_t* column = a + first * sm + c * sk;
      for (int64_t r = 0; r < count; ++r) packed[r * kp + c] = column[r * sm];
    }
    for (int64_t r = 0; r < count; ++r) std::memset(packed + r * kp + k, 0, kp - k);
  }
  std::memset(packed + count * kp, 0, (rows - count) * kp);
}

// One 32 × 32 block of int32 products: A rows at `a` (stride lda), B's two column blocks packed. Tiles
// are not renamed, so each load comes right before the first product that reads it, and the next
// step's loads wait only on the products that read their tiles.
inline void block_product(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1, int64_t kp, int32_t* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < kp; k += AMX_K) {
    _tile_loadd(4, a + k, lda);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_loadd(7, b1 + k * 16, 64);
    _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + k, lda);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  constexpr int64_t ldc = AMX_N * sizeof(int32_t);
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
  _tile_stored(2, c + 16 * AMX_N, ldc);
  _tile_stored(3, c + 16 * AMX_N + 16, ldc);
}

// dequantize() of cpu_kernels.cpp on one block: rows × cols of c (stride AMX_N) into out (stride ldo).
template <typename Out>
inline void block_epilogue(const int32_t* c, int64_t rows, int64_t cols, const float* row_scale, int64_t row_scale_stride,
                           const float* column, const float* bias, Out* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = row_scale[r * row_scale_stride];
    const int32_t* a = c + r * AMX_N;
    Out* o = out + r * ldo;
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) store(float(a[j]) * (s * column[j]) + bias[j], o + j);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) store(float(a[j]) * (s * column[j]), o + j);
    }
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
#pragma omp parallel
  {
    configure_tiles();
    std::vector<float> column(n);
    for (int64_t j = 0; j < n; ++j) column[j] = col_scale[j * col_scale_stride] / divisor;
    std::vector<int8_t> panel((direct ? AMX_M : group) * kp);  // in place, the last rows short of 32
    alignas(64) int32_t c[AMX_M * AMX_N];
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = g * group, count = std::min(group, m - first);
      const int64_t whole = direct ? count / AMX_M * AMX_M : 0;
      if (whole < count) {
        pack_a(a, first + whole, count - whole, k, sam, sak, kp, panel.data());
      }
      for (int64_t r0 = 0; r0 < count; r0 += AMX_M) {
        const bool in_place = r0 < whole;
        const int8_t* rows_a = in_place ? a + (first + r0) * sam : panel.data() + (r0 - whole) * kp;
        const int64_t row = first + r0;
        for (int64_t j0 = 0; j0 < n; j0 += AMX_N) {
          const int8_t* b0 = packed_b + (j0 / 16) * kp * 16;
          const int8_t* b1 = b0 + kp * 16;
          const int64_t cols = std::min(AMX_N, n - j0);
          block_product(rows_a, in_place ? sam : kp, b0, b1, kp, c);
          block_epilogue(c, std::min(AMX_M, count - r0), cols, row_scale + row * row_scale_stride, row_scale_stride,
                         column.data() + j0, bias == nullptr ? nullptr : bias + j0, out + row * n + j0, n);
        }
      }
    }
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
