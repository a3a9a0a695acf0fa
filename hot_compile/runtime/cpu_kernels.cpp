// HOT's CPU kernels on the primitives of cpu_primitives.cpp, which precedes this file in one
// translation unit: the row and column passes (transform, statistics, quantize) and the dequantizing
// epilogue of the integer GEMM, exported with C linkage for hot_compile/runtime/cpu_kernels.py.

namespace {

template <typename T>
void load_row(const T* x, int64_t n, int64_t stride, int64_t padded, float* row) {
  if (stride == 1) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) row[c] = to_float(x[c]);
  } else {
    for (int64_t c = 0; c < n; ++c) row[c] = to_float(x[c * stride]);
  }
  std::fill(row + n, row + padded, 0.0f);
}

// A row of `n` values `stride` apart, zero-padded to `width`, times the Hadamard matrix in blocks of 16,
// into `row`, in one sweep with the values in registers; returns max|v| (NaN if any is NaN).
template <typename T>
float load_hadamard_row(const T* x, int64_t n, int64_t stride, int64_t width, float* row) {
  // Two running maxima: one would chain each vector's max to the last.
  Float16x m0 = {}, m1 = {};
  int64_t c = 0;
  for (; stride == 1 && c + 32 <= n; c += 32) {
    const Float16x v0 = hadamard16(load16(x + c)), v1 = hadamard16(load16(x + c + 16));
    store16(v0, row + c);
    store16(v1, row + c + 16);
    m0 = max_magnitude(m0, v0);
    m1 = max_magnitude(m1, v1);
  }
  for (; c < n; c += 16) {
    const bool whole = stride == 1 && c + 16 <= n;
    const Float16x v = hadamard16(whole ? load16(x + c) : load16(x + c * stride, std::min<int64_t>(16, n - c), stride));
    store16(v, row + c);
    m0 = max_magnitude(m0, v);
  }
  std::fill(row + c, row + width, 0.0f);
  return lanes_max(max_magnitude(m0, m1));
}

template <typename T>
void rows_quantize(const T* x, int64_t rows, int64_t n, int64_t row_stride, int64_t col_stride, int64_t width,
                   bool hadamard, float qmax, bool stochastic, uint32_t offset, const float* scale_in,
                   int64_t scale_stride, int8_t* q, float* scale_out, float* amax_out) {
#pragma omp parallel
  {
    std::vector<float> row(width);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* v = row.data();
      float amax;
      if (hadamard) {
        amax = load_hadamard_row(x + r * row_stride, n, col_stride, width, v);
      } else {
        load_row(x + r * row_stride, n, col_stride, width, v);
        amax = scale_in == nullptr ? span_amax(v, width) : 0.0f;
      }
      float scale;
      if (scale_in != nullptr) {
        scale = scale_in[r * scale_stride];
      } else {
        if (amax_out != nullptr) {
          amax_out[r] = amax;
          continue;
        }
        scale = scale_of(amax, qmax);
        scale_out[r] = scale;
      }
      const float inverse = 1.0f / scale;
      quantize_span<false>(stochastic, v, &inverse, width, qmax, uint32_t(r * width), offset, q + r * width);
    }
  }
}

// The transform of a tile: `count` rows of basis @ x[16 rows of block, TILE columns].
inline void transform_tile(const float* basis, int64_t count, const float (*xb)[TILE], float (*yb)[TILE]) {
  for (int64_t i = 0; i < count; ++i) {
    float* y = yb[i];
#pragma omp simd
    for (int64_t c = 0; c < TILE; ++c) y[c] = 0.0f;
    for (int64_t j = 0; j < BLOCK; ++j) {
      const float m = basis[i * BLOCK + j];
#pragma omp simd
      for (int64_t c = 0; c < TILE; ++c) y[c] += m * xb[j][c];
    }
  }
}

template <typename T>
void load_tile(const T* x, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride, int64_t block,
               int64_t c0, int64_t cols, float (*xb)[TILE]) {
  for (int64_t j = 0; j < BLOCK; ++j) {
    const int64_t r = block * BLOCK + j;
    if (r < n) {
      load_row(x + r * row_stride + c0 * col_stride, cols, col_stride, TILE, xb[j]);
    } else {
      std::fill(xb[j], xb[j] + TILE, 0.0f);
    }
  }
}

// Columns g..g + 15 of a whole block (16 rows) of the tile, each column times the Hadamard matrix
// (Sylvester order) by butterflies, 4 additions per value where the dense product takes 16
// multiply-adds, into v[row] (columns past `cols` zero).
template <typename T>
inline void hadamard_columns16(const T* first, int64_t row_stride, int64_t col_stride, int64_t g, int64_t cols,
                               Float16x (&v)[BLOCK]) {
  const int64_t count = std::max<int64_t>(0, std::min<int64_t>(16, cols - g));
  if (count == 16 && col_stride == 1) {  // the common case, without a branch per row
#pragma GCC unroll 16
    for (int64_t j = 0; j < BLOCK; ++j) {
      // The next tile's part of the row, which a pass reaches next: 16 rows read 128 bytes at a time are
      // more streams than the hardware prefetcher follows (0.8-0.9 of the pass's time on Zen 4).
      __builtin_prefetch(first + j * row_stride + g + TILE);
      v[j] = load16(first + j * row_stride + g);
    }
  } else {
    for (int64_t j = 0; j < BLOCK; ++j) v[j] = load16(first + j * row_stride + g * col_stride, count, col_stride);
  }
#pragma GCC unroll 4
  for (int64_t h = 1; h < BLOCK; h <<= 1) {
#pragma GCC unroll 16
    for (int64_t j = 0; j < BLOCK; ++j) {
      if (j & h) continue;
      const Float16x u = v[j], w = v[j + h];
      v[j] = u + w;
      v[j + h] = u - w;
    }
  }
}

// A whole block of the tile transformed (hadamard_columns16), 16 columns at a time held in registers
// through the four stages, so the tile is written once.
template <typename T>
void load_hadamard_tile(const T* x, int64_t row_stride, int64_t col_stride, int64_t block, int64_t c0, int64_t cols,
                        float (*xb)[TILE]) {
  const T* first = x + block * BLOCK * row_stride + c0 * col_stride;
  for (int64_t g = 0; g < TILE; g += 16) {
    Float16x v[BLOCK];
    hadamard_columns16(first, row_stride, col_stride, g, cols, v);
#pragma GCC unroll 16
    for (int64_t j = 0; j < BLOCK; ++j) store16(v[j], xb[j] + g);
  }
}

// Folds `cols` transformed values into per-column max|y| (a NaN wins) and, with Sums, Σ|y| and Σy².
template <bool Sums>
inline void accumulate(const float* y, int64_t cols, float* amax, float* abs_sum, float* sq_sum) {
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    const Float16x v = load16(y + c);
    store16(max_magnitude(load16(amax + c), v), amax + c);
    if constexpr (Sums) {
      store16(load16(abs_sum + c) + magnitude(v), abs_sum + c);
      store16(load16(sq_sum + c) + v * v, sq_sum + c);
    }
  }
  for (; c < cols; ++c) {
    amax[c] = max_magnitude(amax[c], y[c]);
    if constexpr (Sums) {
      abs_sum[c] += std::fabs(y[c]);
      sq_sum[c] += y[c] * y[c];
    }
  }
}

// The per-column max|y| of rows `rows[0..count)` of a whole block's transform folded into amax[0..cols)
// (a NaN wins), from registers: the maxima alone need no tile.
template <typename T>
void fold_hadamard_amax(const T* x, int64_t row_stride, int64_t col_stride, int64_t block, int64_t c0, int64_t cols,
                        const int64_t* rows, int64_t count, float* amax) {
  const T* first = x + block * BLOCK * row_stride + c0 * col_stride;
  for (int64_t g = 0; g < cols; g += 16) {
    Float16x v[BLOCK];
    hadamard_columns16(first, row_stride, col_stride, g, cols, v);
    Float16x m = {};
    for (int64_t i = 0; i < count; ++i) m = max_magnitude(m, v[rows[i]]);
    float maxima[16];
    store16(m, maxima);
    accumulate<false>(maxima, std::min<int64_t>(16, cols - g), amax + g, nullptr, nullptr);
  }
}

// Which row of the Hadamard matrix (Sylvester order) each of the `rank` rows of `basis` is, into
// `rows`; false if some row is none.
inline bool sylvester_rows(const float* basis, int64_t rank, int64_t* rows) {
  for (int64_t i = 0; i < rank; ++i) {
    rows[i] = -1;
    for (int64_t p = 0; p < BLOCK && rows[i] < 0; ++p) {
      bool same = true;
      for (int64_t j = 0; j < BLOCK && same; ++j) {
        same = basis[i * BLOCK + j] == ((__builtin_popcountll(p & j) & 1) ? -1.0f : 1.0f);
      }
      if (same) rows[i] = p;
    }
    if (rows[i] < 0) return false;
  }
  return true;
}

// codes[i][c] for i < count, c < cols into q[i · q_row + c · q_col]: 16 rows of 64 by byte transposes
// where q_row is 1, since its columns are then 16 contiguous bytes.
inline void store_columns(const int8_t (*codes)[TILE], int64_t count, int64_t cols, int8_t* q, int64_t q_row, int64_t q_col) {
#if defined(__AVX2__)
  if (count == BLOCK && cols == TILE && q_row == 1) {
    transpose16x32(codes[0], TILE, q, q_col, 0);
    transpose16x32(codes[0] + 32, TILE, q + 32 * q_col, q_col, 0);
    return;
  }
#endif
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t i = 0; i < count; ++i) q[i * q_row + c * q_col] = codes[i][c];
  }
}

// Column transforms (along dim 0): whole blocks by `basis`, the rows after them zero-padded to 16 by
// `tail` (when given), `out_rows` rows in all. Where every row of `basis` is a row of the Hadamard matrix
// (HQ's weight, the Walsh rows of HLA and ABC), whole blocks take the butterflies. stats: per-column max|y| and, when
// `abs_sum` is given, Σ|y| and Σy² of the result;
// quantize: q = level(y / scale[c]) into [out_rows, k] (strides q_row, q_col: row-major, or column-major for
// a product that reads q transposed, HLA's q(P g)ᵀ).
template <typename T>
void cols_pass(const T* x, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride, const float* basis,
               const float* tail, int64_t rank, int64_t out_rows, float* amax, float* abs_sum, float* sq_sum,
               const float* scale, int64_t scale_stride, float qmax, bool stochastic, uint32_t offset, int8_t* q,
               int64_t q_row, int64_t q_col) {
  const int64_t whole = n / BLOCK;
  const int64_t blocks = tail != nullptr && n % BLOCK ? whole + 1 : whole;
  const int64_t tiles = (k + TILE - 1) / TILE;
  int64_t hadamard_rows[BLOCK];
  const bool butterflies = sylvester_rows(basis, rank, hadamard_rows);
  const bool stats = amax != nullptr, sums = abs_sum != nullptr;
  if (stats) std::fill(amax, amax + k, 0.0f);
  if (sums) {
    std::fill(abs_sum, abs_sum + k, 0.0f);
    std::fill(sq_sum, sq_sum + k, 0.0f);
  }
#pragma omp parallel
  {
    std::vector<float> local(stats ? 3 * k : 0, 0.0f);
    std::vector<float> inverse(stats ? 0 : k);
    for (size_t c = 0; c < inverse.size(); ++c) inverse[c] = 1.0f / scale[c * scale_stride];
    alignas(64) float xb[BLOCK][TILE];
    alignas(64) float yb[BLOCK][TILE];
    // A tile's codes where q is column-major, written out a column of the tile at a time.
    alignas(64) int8_t codes[BLOCK][TILE];
#pragma omp for schedule(static) collapse(2)
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t c0 = t * TILE, cols = std::min(TILE, k - c0);
        const int64_t count = std::min(rank, out_rows - b * rank);
        if (count <= 0) continue;
        const bool hadamard = b < whole && butterflies;
        if (hadamard && stats && !sums) {
          fold_hadamard_amax(x, row_stride, col_stride, b, c0, cols, hadamard_rows, count, local.data() + c0);
          continue;
        }
        if (hadamard) {
          load_hadamard_tile(x, row_stride, col_stride, b, c0, cols, xb);
        } else {
          load_tile(x, n, k, row_stride, col_stride, b, c0, cols, xb);
        }
        const float* result[BLOCK];
        if (hadamard) {
          for (int64_t i = 0; i < count; ++i) result[i] = xb[hadamard_rows[i]];
        } else {
          transform_tile(b < whole ? basis : tail, count, xb, yb);
          for (int64_t i = 0; i < count; ++i) result[i] = yb[i];
        }
        for (int64_t i = 0; i < count; ++i) {
          const int64_t out_row = b * rank + i;
          if (stats) {
            float* m = local.data() + c0;
            if (sums) {
              accumulate<true>(result[i], cols, m, m + k, m + 2 * k);
            } else {
              accumulate<false>(result[i], cols, m, nullptr, nullptr);
            }
          } else {
            quantize_span<true>(stochastic, result[i], inverse.data() + c0, cols, qmax, uint32_t(out_row * k + c0), offset,
                                q_col == 1 ? q + out_row * q_row + c0 : codes[i]);
          }
        }
        if (!stats && q_col != 1) store_columns(codes, count, cols, q + b * rank * q_row + c0 * q_col, q_row, q_col);
      }
    }
    if (stats) {
#pragma omp critical
      for (int64_t c = 0; c < k; ++c) {
        amax[c] = max_magnitude(amax[c], local[c]);
        if (sums) {
          abs_sum[c] += local[k + c];
          sq_sum[c] += local[2 * k + c];
        }
      }
    }
  }
}

// One row of the dequantize: out[c] = a[c] · (s · column[c]) (+ bias[c]), column[c] = col_scale[c] / divisor.
template <typename Out>
inline void dequantize_row(const int32_t* a, int64_t cols, float s, const float* column, const float* bias, Out* o) {
  if (bias != nullptr) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) store(float(a[c]) * (s * column[c]) + bias[c], o + c);
  } else {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) store(float(a[c]) * (s * column[c]), o + c);
  }
}

template <typename Out>
void dequantize(const int32_t* acc, int64_t rows, int64_t cols, int64_t acc_stride, const float* row_scale,
                int64_t row_scale_stride, const float* col_scale, int64_t col_scale_stride, float divisor,
                const float* bias, Out* out) {
#pragma omp parallel
  {
    std::vector<float> column(cols);
    for (int64_t c = 0; c < cols; ++c) column[c] = col_scale[c * col_scale_stride] / divisor;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(acc + r * acc_stride, cols, row_scale[r * row_scale_stride], column.data(), bias, out + r * cols);
    }
  }
}

template <typename F>
void by_dtype(int64_t dtype, const void* x, F&& f) {
  switch (dtype) {
    case FLOAT32: return f(static_cast<const float*>(x));
    case BFLOAT16: return f(static_cast<const BFloat16*>(x));
    default: return f(static_cast<const _Float16*>(x));
  }
}

}  // namespace

extern "C" {

void hot_rows_quantize(const void* x, int64_t dtype, int64_t rows, int64_t n, int64_t row_stride, int64_t col_stride,
                       int64_t width, int64_t hadamard, int64_t qmax, int64_t stochastic, uint32_t offset,
                       const float* scale_in, int64_t scale_stride, int8_t* q, float* scale_out, float* amax_out) {
  by_dtype(dtype, x, [&](auto* t) {
    rows_quantize(t, rows, n, row_stride, col_stride, width, hadamard != 0, float(qmax), stochastic != 0, offset,
                  scale_in, scale_stride, q, scale_out, amax_out);
  });
}

void hot_cols_stats(const void* x, int64_t dtype, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride,
                    const float* basis, const float* tail, int64_t rank, int64_t out_rows, float* amax,
                    float* abs_sum, float* sq_sum) {
  by_dtype(dtype, x, [&](auto* t) {
    cols_pass(t, n, k, row_stride, col_stride, basis, tail, rank, out_rows, amax, abs_sum, sq_sum, nullptr, 0,
              0.0f, false, 0u, nullptr, 0, 1);
  });
}

void hot_cols_quantize(const void* x, int64_t dtype, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride,
                       const float* basis, const float* tail, int64_t rank, int64_t out_rows, const float* scale,
                       int64_t scale_stride, int64_t qmax, int64_t stochastic, uint32_t offset, int8_t* q,
                       int64_t q_row, int64_t q_col) {
  by_dtype(dtype, x, [&](auto* t) {
    cols_pass(t, n, k, row_stride, col_stride, basis, tail, rank, out_rows, nullptr, nullptr, nullptr, scale,
              scale_stride, float(qmax), stochastic != 0, offset, q, q_row, q_col);
  });
}

void hot_dequantize(const int32_t* acc, int64_t rows, int64_t cols, int64_t acc_stride, const float* row_scale,
                    int64_t row_scale_stride, const float* col_scale, int64_t col_scale_stride, float divisor,
                    const float* bias, void* out, int64_t out_dtype) {
  switch (out_dtype) {
    case FLOAT32:
      return dequantize(acc, rows, cols, acc_stride, row_scale, row_scale_stride, col_scale, col_scale_stride,
                        divisor, bias, static_cast<float*>(out));
    case BFLOAT16:
      return dequantize(acc, rows, cols, acc_stride, row_scale, row_scale_stride, col_scale, col_scale_stride,
                        divisor, bias, static_cast<BFloat16*>(out));
    default:
      return dequantize(acc, rows, cols, acc_stride, row_scale, row_scale_stride, col_scale, col_scale_stride,
                        divisor, bias, static_cast<_Float16*>(out));
  }
}

}  // extern "C"
