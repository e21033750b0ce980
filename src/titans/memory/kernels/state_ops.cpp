// State-sized products of the fused memory scan (fused.py), for float32 on CPUs with AVX-512 (compiled only where
// the build targets AVX-512: elsewhere the module holds the chunk loop alone, see the end of this file).
//
// A chunk touches each state matrix W [K, N] (1 MiB at the benchmark's shape) only through products with
// n = 16 rows: X W, G Wᵀ and rank-n updates W' = βW + cS + α Aᵀ G. The states of a training step do not fit in
// cache, so each product streams its matrix from DRAM; MKL's small-M kernels then wait on memory latency
// (`titans bench matmul` measures it). These kernels read the matrix in the order they use it, prefetch what
// comes next into L2 by hand (software prefetch), keep every partial sum in registers, and write the state
// update in one pass (measurements: docs/PERFORMANCE.md). The update's pass also forms the
// other products a chunk needs of the same inputs at that point (`Pass`), so that they cost no further read of the
// state. Plain ATen references beside them in state_ops.py; tests/memory/test_state_ops.py compares the two.
#include "state_ops.h"

#ifdef __AVX512F__
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr int V = 16;  // floats per zmm register
constexpr int R = 16;  // rows per register block: one accumulator per row
// Rows ahead that the dot-product `g Wᵀ` prefetches: 8 rows cover DRAM latency (4 rows measured slower).
constexpr int64_t PREFETCH_ROWS = 8;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int64_t total_rows(const RowBlocks& x) {
  int64_t M = 0;
  for (const auto& t : x) M += t.size(1);
  return M;
}

// Batch element b of RowBlocks [B, M, K] (any strides) -> dst [K][Mp], Mp ≥ M, rows M to Mp left as they are
// (zeros in a zeroed buffer). 64 columns at a time, so that the columns being written (64 · 4 · Mp bytes) stay in L1.
void transpose_batch(const RowBlocks& x, int64_t b, int64_t Mp, float* dst) {
  const int64_t K = x[0].size(2);
  int64_t row = 0;
  for (const auto& t : x) {
    const float* src = t.data_ptr<float>() + b * t.stride(0);
    const int64_t rs = t.stride(1), cs = t.stride(2);
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      const int64_t k1 = std::min<int64_t>(K, k0 + 64);
      for (int64_t r = 0; r < t.size(1); ++r)
        for (int64_t k = k0; k < k1; ++k) dst[k * Mp + row + r] = src[r * rs + k * cs];
    }
    row += t.size(1);
  }
}

// RowBlocks [B, M, K] -> [B][K][Mp] with Mp = M rounded up to R and zero rows: row block r of column k is
// contiguous, and the padding rows contribute zeros, so the inner loops never test the row count. Plain loops:
// two ATen calls (zeros, copy_) per product cost more than the copy itself.
std::vector<float> transpose_padded(const RowBlocks& x, int64_t Mp) {
  const int64_t B = x[0].size(0), K = x[0].size(2);
  std::vector<float> out(B * K * Mp, 0.0f);
  for (int64_t b = 0; b < B; ++b) transpose_batch(x, b, Mp, out.data() + b * K * Mp);
  return out;
}

// Where each row of RowBlocks [B, M, N] (inner stride 1) starts: [B][M] pointers, read through `pack_columns`.
std::vector<const float*> row_pointers(const RowBlocks& x) {
  const int64_t B = x[0].size(0), M = total_rows(x);
  std::vector<const float*> rows(B * M);
  int64_t row = 0;
  for (const auto& t : x) {
    const float* data = t.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t r = 0; r < t.size(1); ++r) rows[b * M + row + r] = data + b * t.stride(0) + r * t.stride(1);
    row += t.size(1);
  }
  return rows;
}

// Splits `extent` (a multiple of `align`) into `parts` aligned ranges.
std::pair<int64_t, int64_t> part_range(int64_t extent, int64_t parts, int64_t part, int64_t align) {
  const int64_t units = extent / align, lo = units * part / parts, hi = units * (part + 1) / parts;
  return {lo * align, hi * align};
}

// Enough tasks for every thread to have two when the batch alone does not give them. Called from a slice of the
// native scan (scan.cpp), which already runs on its own thread, one task per batch element.
int64_t parts_per_batch(int64_t batch, int64_t units) {
  if (at::in_parallel_region()) return 1;
  const int64_t want = (2 * at::get_num_threads() + batch - 1) / batch;
  return std::max<int64_t>(1, std::min(want, units));
}

// Y[:, j0:j1] (=|+=) X W for one batch element. xt: X transposed and padded ([K, Mp]).
// Each 16-column strip of W (one cache line per row) is walked down its K rows once per row block, with all
// Mp × 16 partial sums of a row block in registers; the next strip is prefetched into L2 meanwhile, since its
// lines are 4·N bytes apart and no hardware prefetcher follows that stride across pages.
void xw_range(const float* xt, int64_t Mp, const float* W, float* Y, int64_t M, int64_t K, int64_t N,
              int64_t j0, int64_t j1, bool accumulate) {
  // Rows of W in blocks of 256, so that the block of xt the broadcasts read (16 KiB) stays in L1 across the
  // strips: 10% faster than one pass at K = 1024.
  constexpr int64_t KB = 256;
  for (int64_t kb = 0; kb < K; kb += KB) {
    const int64_t ke = std::min<int64_t>(K, kb + KB);
    const bool add = accumulate || kb > 0;
    for (int64_t j = j0; j < j1; j += V) {
      const bool prefetch = j + V < j1;
      for (int64_t rb = 0; rb < Mp; rb += R) {
        __m512 acc[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        const float* w = W + j;
        const float* x = xt + rb;
        for (int64_t k = kb; k < ke; ++k) {
          if (prefetch && rb == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * N + V), _MM_HINT_T1);
          const __m512 wk = _mm512_loadu_ps(w + k * N);
          const float* xk = x + k * Mp;
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), wk, acc[r]);
        }
        const int64_t rows = std::min<int64_t>(R, M - rb);
        for (int64_t r = 0; r < rows; ++r) {
          float* y = Y + (rb + r) * N + j;
          _mm512_storeu_ps(y, add ? _mm512_add_ps(_mm512_loadu_ps(y), acc[r]) : acc[r]);
        }
      }
    }
  }
}

// Lane r of the result is the sum of the 16 lanes of a[r] (a transpose-and-add tree: 4 levels, 30 shuffles).
inline __m512 reduce16(const __m512* a) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: t[i] = [a[2i] (8 lanes) | a[2i+1] (8 lanes)]
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: u[i] = [a[4i] | a[4i+1] | a[4i+2] | a[4i+3]], 4 lanes each
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quarter q of v[i]: a[8i+q] (2 lanes), a[8i+4+q] (2 lanes)
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter q: a[q], a[4+q], a[8+q], a[12+q]; lane 4q+p holds a[q+4p], so lane r is read from 4(r%4) + r/4.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// Copies rows [0, M) × columns [n0, n0 + 16·nv) of G (row r starting at G[r]) to `dst` as [Mp][nv][16],
// contiguous. Rows of G are 4·N bytes apart; with N = 1024 all 16 of a block would fall in one L1 set (8 ways) and
// evict each other. Rows from M to Mp are zeros.
void pack_columns(const float* const* G, int64_t M, int64_t Mp, int64_t n0, int64_t nv, float* dst) {
  for (int64_t r = 0; r < M; ++r) std::copy(G[r] + n0, G[r] + n0 + nv * V, dst + r * nv * V);
  std::fill(dst + M * nv * V, dst + Mp * nv * V, 0.0f);
}

// Y[:, k0:k1] (=|+=) G Wᵀ for one batch element with N ≤ 256, computed as its transpose Yᵀ = W Gᵀ so that no sum
// runs across lanes: gt is G transposed and padded ([N, Mp], at most 16 KiB per row block: L1). 16 rows of W
// (contiguous: 16·4·N bytes) are walked side by side, each element broadcast against a vector of 16 rows of Gᵀ,
// the 16 × 16 block of Yᵀ in registers; the next 16 rows are prefetched into L2 meanwhile. (For wider W the 16
// rows, 4·N bytes apart, would share L1 sets: `xwt_dots_range`.)
void xwt_range(const float* gt, int64_t Mp, const float* W, float* Y, int64_t M, int64_t K, int64_t N,
               int64_t k0, int64_t k1, bool accumulate) {
  alignas(64) float block[R][V];
  for (int64_t kb = k0; kb < k1; kb += R) {
    const int64_t rows_k = std::min<int64_t>(R, k1 - kb);
    const float* w[R];
    for (int i = 0; i < R; ++i) w[i] = W + std::min<int64_t>(kb + i, k1 - 1) * N;  // a short block repeats a row
    const bool prefetch = kb + R < k1;
    for (int64_t rb = 0; rb < Mp; rb += R) {
      __m512 acc[R];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t n = 0; n < N; ++n) {
        if (prefetch && rb == 0 && n % V == 0)
          for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(W + (kb + R + i) * N + n), _MM_HINT_T1);
        const __m512 g = _mm512_loadu_ps(gt + n * Mp + rb);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i][n]), g, acc[i]);
      }
      for (int i = 0; i < rows_k; ++i) _mm512_store_ps(block[i], acc[i]);  // lane r: Y[rb + r, kb + i]
      const int64_t rows = std::min<int64_t>(R, M - rb);
      for (int64_t r = 0; r < rows; ++r) {
        float* y = Y + (rb + r) * K + kb;
        for (int i = 0; i < rows_k; ++i) y[i] = accumulate ? y[i] + block[i][r] : block[i][r];
      }
    }
  }
}

// Y[:, k0:k1] (=|+=) G Wᵀ for one batch element by dot products, Y[r, k] = G[r, :] · W[k, :], for wide W
// (N > 256); row r of G starts at G[r].
// Row k of W is contiguous. Columns go in blocks of up to 256: a row block of G (16 KiB, packed) stays in L1 while
// the rows of W stream past; each block's sums are reduced across lanes and added into Y.
void xwt_dots_range(const float* const* G, const float* W, float* Y, int64_t M, int64_t K, int64_t N,
                    int64_t k0, int64_t k1, bool accumulate) {
  alignas(64) float sums[R];
  const int64_t Mp = round_up(M, R), block = std::min<int64_t>(N, 256);
  std::vector<float> packed(Mp * block);
  for (int64_t n0 = 0; n0 < N; n0 += block) {
    const int64_t nv = (std::min(N, n0 + block) - n0) / V;  // the last block may be narrower
    const bool add = accumulate || n0 > 0;
    pack_columns(G, M, Mp, n0, nv, packed.data());
    for (int64_t k = k0; k < k1; ++k) {
      const float* w = W + k * N + n0;
      if (k + PREFETCH_ROWS < k1)
        for (int64_t v = 0; v < nv; ++v) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_ROWS * N + v * V), _MM_HINT_T1);
      for (int64_t rb = 0; rb < Mp; rb += R) {
        __m512 acc[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        const float* g = packed.data() + rb * nv * V;
        for (int64_t v = 0; v < nv; ++v) {
          const __m512 wv = _mm512_loadu_ps(w + v * V);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(g + (r * nv + v) * V), wv, acc[r]);
        }
        _mm512_store_ps(sums, reduce16(acc));
        const int64_t rows = std::min<int64_t>(R, M - rb);
        for (int64_t r = 0; r < rows; ++r) {
          float* y = Y + (rb + r) * K + k;
          *y = add ? *y + sums[r] : sums[r];
        }
      }
    }
  }
}

// One batch element's operands of `combine_blocks` (pointers offset to it). From one read of the inputs W, S, P, Q
// ([K, N], row-major) the pass writes
//   out  = β W + c S + Aᵀ G                        (α folded into A; S may be absent)
//   out2 = e S + Aᵀ G2                             (TWO: the forward pass's W' and S')
// and, from the same reads, before anything is written,
//   dots ⟨P, W⟩, ⟨P, S⟩                            (P present: the backward pass's ∂β_n, ∂c_n, ∂e_n)
//   yw += x W,  ys += x S                          (XW: the queries' h W⁰, h S⁰; the backward's a ∂W', a ∂S')
//   zw = gw Wᵀ + gs Sᵀ,  zp = gp Pᵀ + gq Qᵀ         (XWT: the backward's ∂a and ∂h)
// Each of these would otherwise stream the state from DRAM once more (a chunk's states do not fit in cache).
struct Pass {
  float* out;
  const float *W, *S, *P, *Q;
  float* out2;
  float beta, c, e;
  const float* ap;           // A transposed, padded and scaled by α: [K][Mp]
  const float *gp, *gp2;     // G, G2 packed by strips: [N / width][Mp][width]
  int64_t Mp;
  double* dots;              // ⟨P, W⟩, ⟨P, S⟩ added here
  const float* xt;           // x transposed and padded: [K][Mxp]
  int64_t Mx, Mxp;
  float *yw, *ys;            // (x W)ᵀ, (x S)ᵀ: [N][Mxp], added to
  const float* gt[4];        // gw, gs, gp, gq transposed and padded: [N][Mgp]
  int64_t Mg, Mgp;
  float *zw, *zp;            // [Mg][K]
  int64_t K, N;
};

// Rows [k0, k1) of one batch element's pass (`Pass`). T rows of the state at a time, all their columns, in strips of
// SW vectors. The T × SW sums of Aᵀ G of a strip (and of Aᵀ G2) stay in registers over all Mp rows of G, so each
// load of G serves T multiply-adds and the T·SW chains run side by side; the state's own terms (and the dots) are
// added after the sums, which so never wait on memory. A row block is T whole rows, contiguous in DRAM; the next one
// is prefetched into L2 strip by strip. The strip just read is copied to a small buffer `tile` for the riders: its
// rows, 4·N bytes apart in the state, would share one L1 set (8 ways) there. `x W` and `g Wᵀ` both broadcast each
// element of the tile against a vector of 16 rows of x or g: x W is accumulated transposed (one vector per column,
// in yw); g Wᵀ keeps T partial sums per output and per 16 rows of g in `zsum` across the strips of a row block.
template <int T, int SW, bool TWO, bool XW, bool XWT>
void combine_blocks(const Pass& p, int64_t k0, int64_t k1) {
  constexpr int WIDTH = SW * V;
  const int64_t N = p.N, Mp = p.Mp;
  const __m512 vb = _mm512_set1_ps(p.beta), vc = _mm512_set1_ps(p.c), ve = _mm512_set1_ps(p.e);
  const bool stream = p.out != p.W && reinterpret_cast<uintptr_t>(p.out) % 64 == 0 &&
                      (!TWO || reinterpret_cast<uintptr_t>(p.out2) % 64 == 0);
  alignas(64) float tile[4][T][WIDTH];  // W, S, P, Q of the current strip
  std::vector<float> zsum(XWT ? p.Mgp / V * 2 * T * V : 0);
  __m512d dot_acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  for (int64_t kb = k0; kb < k1; kb += T) {
    const int rows = static_cast<int>(std::min<int64_t>(T, k1 - kb));
    const float* a[T];
    const float* x[T];
    for (int i = 0; i < T; ++i) {  // a short block repeats a row (its results are not written)
      a[i] = p.ap + std::min<int64_t>(kb + i, k1 - 1) * Mp;
      if constexpr (XW) x[i] = p.xt + std::min<int64_t>(kb + i, k1 - 1) * p.Mxp;
    }
    if constexpr (XWT) std::fill(zsum.begin(), zsum.end(), 0.0f);
    const int64_t next = kb + T;
    const int next_rows = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(T, k1 - next)));
    for (int64_t j = 0; j < N; j += WIDTH) {
      for (int i = 0; i < next_rows; ++i)
        for (int v = 0; v < SW; ++v) {
          const int64_t ahead = (next + i) * N + j + v * V;
          for (const float* m : {p.W, p.S, p.P, p.Q})
            if (m) _mm_prefetch(reinterpret_cast<const char*>(m + ahead), _MM_HINT_T1);
        }
      __m512 acc[T][SW], acc2[TWO ? T : 1][SW];
#pragma GCC unroll 16
      for (int i = 0; i < T; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < SW; ++v) {
          acc[i][v] = _mm512_setzero_ps();
          if constexpr (TWO) acc2[i][v] = _mm512_setzero_ps();
        }
      const float* g = p.gp + j * Mp;
      const float* g2 = TWO ? p.gp2 + j * Mp : nullptr;
      for (int64_t r = 0; r < Mp; ++r) {
        __m512 gv[SW], gv2[TWO ? SW : 1];
#pragma GCC unroll 4
        for (int v = 0; v < SW; ++v) {
          gv[v] = _mm512_loadu_ps(g + r * WIDTH + v * V);
          if constexpr (TWO) gv2[v] = _mm512_loadu_ps(g2 + r * WIDTH + v * V);
        }
#pragma GCC unroll 16
        for (int i = 0; i < T; ++i) {
          const __m512 coef = _mm512_set1_ps(a[i][r]);
#pragma GCC unroll 4
          for (int v = 0; v < SW; ++v) {
            acc[i][v] = _mm512_fmadd_ps(coef, gv[v], acc[i][v]);
            if constexpr (TWO) acc2[i][v] = _mm512_fmadd_ps(coef, gv2[v], acc2[i][v]);
          }
        }
      }
      __m512 dot_w = _mm512_setzero_ps(), dot_s = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int i = 0; i < T; ++i) {
        if (i >= rows) {  // rows past the block's end: zeros in the tile, so that x W adds nothing for them
          if constexpr (XW)
            for (int v = 0; v < SW; ++v)
              _mm512_store_ps(tile[0][i] + v * V, _mm512_setzero_ps()),
                  _mm512_store_ps(tile[1][i] + v * V, _mm512_setzero_ps());
          continue;
        }
#pragma GCC unroll 4
        for (int v = 0; v < SW; ++v) {
          const int64_t at_ = (kb + i) * N + j + v * V;
          const __m512 w = _mm512_loadu_ps(p.W + at_);
          __m512 o = _mm512_fmadd_ps(vb, w, acc[i][v]);
          const __m512 pv = p.P ? _mm512_loadu_ps(p.P + at_) : _mm512_setzero_ps();
          if (p.P) dot_w = _mm512_fmadd_ps(pv, w, dot_w);
          __m512 o2 = _mm512_setzero_ps(), sv = _mm512_setzero_ps();
          if (p.S) {
            sv = _mm512_loadu_ps(p.S + at_);
            o = _mm512_fmadd_ps(vc, sv, o);
            if constexpr (TWO) o2 = _mm512_fmadd_ps(ve, sv, acc2[i][v]);
            if (p.P) dot_s = _mm512_fmadd_ps(pv, sv, dot_s);
          }
          if constexpr (XW || XWT) {
            _mm512_store_ps(tile[0][i] + v * V, w);
            _mm512_store_ps(tile[1][i] + v * V, sv);
          }
          if constexpr (XWT) {
            _mm512_store_ps(tile[2][i] + v * V, pv);
            _mm512_store_ps(tile[3][i] + v * V, _mm512_loadu_ps(p.Q + at_));
          }
          if (stream) {
            _mm512_stream_ps(p.out + at_, o);
            if constexpr (TWO) _mm512_stream_ps(p.out2 + at_, o2);
          } else {
            _mm512_storeu_ps(p.out + at_, o);
            if constexpr (TWO) _mm512_storeu_ps(p.out2 + at_, o2);
          }
        }
      }
      if (p.P) {  // T·SW float terms per lane, then into double lanes: 2^18 float32 terms in one register would lose digits
        dot_acc[0] = _mm512_add_pd(dot_acc[0], _mm512_cvtps_pd(_mm512_castps512_ps256(dot_w)));
        dot_acc[1] = _mm512_add_pd(dot_acc[1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(dot_w, 1)));
        dot_acc[2] = _mm512_add_pd(dot_acc[2], _mm512_cvtps_pd(_mm512_castps512_ps256(dot_s)));
        dot_acc[3] = _mm512_add_pd(dot_acc[3], _mm512_cvtps_pd(_mm512_extractf32x8_ps(dot_s, 1)));
      }
      if constexpr (XW) {  // column c of the strip: (x W)ᵀ[c] += Σ_i W[k_i, c] x[:, k_i], 16 rows of x in the lanes
        for (int64_t q = 0; q < p.Mxp; q += V) {
          __m512 xv[T];
#pragma GCC unroll 16
          for (int i = 0; i < T; ++i) xv[i] = _mm512_loadu_ps(x[i] + q);
          float* yw = p.yw + j * p.Mxp + q;
          float* ys = p.ys + j * p.Mxp + q;
          for (int col = 0; col < WIDTH; ++col) {
            __m512 sw = _mm512_loadu_ps(yw + col * p.Mxp), ss = _mm512_loadu_ps(ys + col * p.Mxp);
#pragma GCC unroll 16
            for (int i = 0; i < T; ++i) {
              sw = _mm512_fmadd_ps(_mm512_set1_ps(tile[0][i][col]), xv[i], sw);
              ss = _mm512_fmadd_ps(_mm512_set1_ps(tile[1][i][col]), xv[i], ss);
            }
            _mm512_storeu_ps(yw + col * p.Mxp, sw), _mm512_storeu_ps(ys + col * p.Mxp, ss);
          }
        }
      }
      if constexpr (XWT) {
        for (int64_t rb = 0; rb < p.Mgp; rb += V) {
          float* zs = zsum.data() + rb / V * 2 * T * V;
          __m512 zw[T], zp[T];
#pragma GCC unroll 16
          for (int i = 0; i < T; ++i) zw[i] = _mm512_loadu_ps(zs + i * V), zp[i] = _mm512_loadu_ps(zs + (T + i) * V);
          for (int col = 0; col < WIDTH; ++col) {
            const int64_t at_ = (j + col) * p.Mgp + rb;
            const __m512 g0 = _mm512_loadu_ps(p.gt[0] + at_), g1 = _mm512_loadu_ps(p.gt[1] + at_);
            const __m512 g2_ = _mm512_loadu_ps(p.gt[2] + at_), g3 = _mm512_loadu_ps(p.gt[3] + at_);
#pragma GCC unroll 16
            for (int i = 0; i < T; ++i) {
              zw[i] = _mm512_fmadd_ps(_mm512_set1_ps(tile[0][i][col]), g0, zw[i]);
              zw[i] = _mm512_fmadd_ps(_mm512_set1_ps(tile[1][i][col]), g1, zw[i]);
              zp[i] = _mm512_fmadd_ps(_mm512_set1_ps(tile[2][i][col]), g2_, zp[i]);
              zp[i] = _mm512_fmadd_ps(_mm512_set1_ps(tile[3][i][col]), g3, zp[i]);
            }
          }
#pragma GCC unroll 16
          for (int i = 0; i < T; ++i) _mm512_storeu_ps(zs + i * V, zw[i]), _mm512_storeu_ps(zs + (T + i) * V, zp[i]);
        }
      }
    }
    if constexpr (XWT)  // lane m of a row's sums is row rb + m of g: write them down the column k of zw, zp
      for (int64_t rb = 0; rb < p.Mgp; rb += V) {
        const float* zs = zsum.data() + rb / V * 2 * T * V;
        for (int i = 0; i < rows; ++i)
          for (int64_t m = 0; m < std::min<int64_t>(V, p.Mg - rb); ++m) {
            p.zw[(rb + m) * p.K + kb + i] = zs[i * V + m];
            p.zp[(rb + m) * p.K + kb + i] = zs[(T + i) * V + m];
          }
      }
  }
  if (p.P) {
    p.dots[0] += _mm512_reduce_add_pd(_mm512_add_pd(dot_acc[0], dot_acc[1]));
    p.dots[1] += _mm512_reduce_add_pd(_mm512_add_pd(dot_acc[2], dot_acc[3]));
  }
  if (stream) _mm_sfence();
}

// G's rows [0, M) (row r starting at G[r]) packed by strips of `width` columns into `dst`: [N / width][Mp][width],
// each strip laid out by `pack_columns`.
void pack_strips(const float* const* G, int64_t M, int64_t Mp, int64_t N, int64_t width, float* dst) {
  for (int64_t j = 0; j < N; j += width) pack_columns(G, M, Mp, j, width / V, dst + j * Mp);
}

void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == dim && t.is_contiguous(),
              name, ": expected a contiguous float32 CPU tensor with ", dim, " dimensions");
}

// Per-batch factors (β, c, e) may be strided views: read once into a vector.
std::vector<float> batch_values(const torch::Tensor& t, const char* name, int64_t B) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 1 && t.size(0) == B, name,
              ": expected a float32 CPU vector with one value per batch element");
  const auto a = t.accessor<float, 1>();
  std::vector<float> values(B);
  for (int64_t b = 0; b < B; ++b) values[b] = a[b];
  return values;
}

// The small operands may be any strided view: they are copied (transposed, padded) before use.
void check_small(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 3, name,
              ": expected a float32 CPU tensor with 3 dimensions");
}

}  // namespace

// out (=|+=) X W: X [B, M, K], W [B, K, N] with N % 16 == 0, out [B, M, N].
void xw(const torch::Tensor& X, const torch::Tensor& W, torch::Tensor out, bool accumulate) {
  check(W, "W", 3), check(out, "out", 3), check_small(X, "X");
  const int64_t B = W.size(0), K = W.size(1), N = W.size(2), M = X.size(1), Mp = round_up(M, R);
  TORCH_CHECK(N % V == 0 && X.size(0) == B && X.size(2) == K && out.size(0) == B && out.size(1) == M &&
              out.size(2) == N, "xw: shapes do not fit");
  const auto xt = transpose_padded({X}, Mp);
  const int64_t parts = parts_per_batch(B, N / V);
  const float* wp = W.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, B * parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / parts;
      const auto [j0, j1] = part_range(N, parts, t % parts, V);
      xw_range(xt.data() + b * K * Mp, Mp, wp + b * K * N, yp + b * M * N, M, K, N, j0, j1, accumulate);
    }
  });
}

// out (=|+=) G Wᵀ: G [B, M, N] (inner stride 1 when N > 256), W [B, K, N] with N % 16 == 0, out [B, M, K].
void xwt(const torch::Tensor& G, const torch::Tensor& W, torch::Tensor out, bool accumulate) {
  check(W, "W", 3), check(out, "out", 3), check_small(G, "G");
  const int64_t B = W.size(0), K = W.size(1), N = W.size(2), M = G.size(1), Mp = round_up(M, R);
  TORCH_CHECK(N % V == 0 && G.size(0) == B && G.size(2) == N && out.size(0) == B && out.size(1) == M &&
              out.size(2) == K, "xwt: shapes do not fit");
  const float* wp = W.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  if (N <= 256) {
    const auto gt = transpose_padded({G}, Mp);
    const int64_t parts = parts_per_batch(B, (K + R - 1) / R);
    at::parallel_for(0, B * parts, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / parts;
        const auto [k0, k1] = part_range(round_up(K, R), parts, t % parts, R);
        if (k0 < K)
          xwt_range(gt.data() + b * N * Mp, Mp, wp + b * K * N, yp + b * M * K, M, K, N, k0, std::min(k1, K), accumulate);
      }
    });
    return;
  }
  TORCH_CHECK(G.stride(2) == 1, "xwt: G must have inner stride 1");
  const auto g = row_pointers({G});
  const int64_t parts = parts_per_batch(B, K);
  at::parallel_for(0, B * parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / parts;
      const auto [k0, k1] = part_range(K, parts, t % parts, 1);
      xwt_dots_range(g.data() + b * M, wp + b * K * N, yp + b * M * K, M, K, N, k0, k1, accumulate);
    }
  });
}

// The row blocks of A [B, M, K] and G [B, M, N] (inner stride 1): block j of each has the same rows.
void check_row_blocks(const RowBlocks& A, const RowBlocks& G, int64_t B, int64_t K, int64_t N, const char* what) {
  TORCH_CHECK(!A.empty() && A.size() == G.size(), what, ": A and G must be lists of the same number of blocks");
  for (size_t j = 0; j < A.size(); ++j) {
    check_small(A[j], "A"), check_small(G[j], "G");
    TORCH_CHECK(A[j].size(0) == B && A[j].size(2) == K && G[j].size(0) == B && G[j].size(1) == A[j].size(1) &&
                G[j].size(2) == N && G[j].stride(2) == 1, what, ": shapes do not fit");
  }
}

// out = β W (+ c S) + α Aᵀ G: W, S, out [B, K, N] with N % 16 == 0; β, c [B]; A [B, M, K] and G [B, M, N] (inner
// stride 1), each as blocks of rows. `out` may be W. From the same reads of the inputs, before the write:
// * with P [B, K, N]: [B, 2] float64, ⟨P, W⟩ and ⟨P, S⟩ (0 without S);
// * with out2 (needs S): out2 = e S + α Aᵀ G2 (e [B], G2 blocks like G);
// * with x [B, Mx, K] (needs S): x W and x S, [B, Mx, N] each;
// * with gt = (gw, gs, gp, gq), each [B, Mg, N] with inner stride 1, and Q [B, K, N] (needs S and P):
//   gw Wᵀ + gs Sᵀ and gp Pᵀ + gq Qᵀ, [B, Mg, K] each.
// Returns [dots, x W, x S, gw Wᵀ + gs Sᵀ, gp Pᵀ + gq Qᵀ], undefined (None) where not asked for.
std::vector<torch::Tensor> combine(torch::Tensor out, const torch::Tensor& W, const torch::Tensor& beta,
                                   const c10::optional<torch::Tensor>& S, const c10::optional<torch::Tensor>& c,
                                   const RowBlocks& A, const RowBlocks& G, double alpha,
                                   const c10::optional<torch::Tensor>& P, const c10::optional<torch::Tensor>& out2,
                                   const c10::optional<torch::Tensor>& e, const c10::optional<RowBlocks>& G2,
                                   const c10::optional<torch::Tensor>& x, const c10::optional<RowBlocks>& gt,
                                   const c10::optional<torch::Tensor>& Q) {
  check(out, "out", 3), check(W, "W", 3);
  const int64_t B = W.size(0), K = W.size(1), N = W.size(2);
  TORCH_CHECK(N % V == 0 && out.sizes() == W.sizes(), "combine: shapes do not fit");
  check_row_blocks(A, G, B, K, N, "combine");
  const int64_t M = total_rows(A), Mp = round_up(M, R);
  TORCH_CHECK(S.has_value() == c.has_value(), "combine: S and c go together");
  const auto betas = batch_values(beta, "beta", B);
  const auto cs = S ? batch_values(*c, "c", B) : std::vector<float>(B, 0.0f);
  for (const auto& [m, name] : {std::pair{&S, "S"}, std::pair{&P, "P"}, std::pair{&Q, "Q"}})
    if (m->has_value()) {
      check(**m, name, 3);
      TORCH_CHECK((*m)->sizes() == W.sizes(), "combine: ", name, " does not fit W");
    }
  TORCH_CHECK(out2.has_value() == e.has_value() && e.has_value() == G2.has_value() && (!out2 || S),
              "combine: out2, e and G2 go together, and need S");
  const auto es = out2 ? batch_values(*e, "e", B) : std::vector<float>(B, 0.0f);
  if (out2) {
    check(*out2, "out2", 3), check_row_blocks(A, *G2, B, K, N, "combine (G2)");
    TORCH_CHECK(out2->sizes() == W.sizes(), "combine: out2 does not fit W");
  }
  TORCH_CHECK(!x || S, "combine: x needs S");
  if (x) {
    check_small(*x, "x");
    TORCH_CHECK(x->size(0) == B && x->size(2) == K, "combine: x does not fit W");
  }
  TORCH_CHECK(gt.has_value() == Q.has_value() && (!gt || (S && P && gt->size() == 4)),
              "combine: gt (four tensors) and Q go together, and need S and P");
  const int64_t Mg = gt ? (*gt)[0].size(1) : 0, Mgp = round_up(Mg, V);
  if (gt)
    for (const auto& t : *gt) {
      check_small(t, "gt");
      TORCH_CHECK(t.size(0) == B && t.size(1) == Mg && t.size(2) == N && t.stride(2) == 1,
                  "combine: gt does not fit W");
    }
  auto at_ = transpose_padded(A, Mp);
  for (auto& v : at_) v *= static_cast<float>(alpha);
  const int64_t Mx = x ? x->size(1) : 0, Mxp = round_up(std::max<int64_t>(Mx, 1), R);
  const auto xt = x ? transpose_padded({*x}, Mxp) : std::vector<float>();
  const auto g = row_pointers(G), g2 = out2 ? row_pointers(*G2) : std::vector<const float*>();
  const int64_t parts = parts_per_batch(B, K);
  std::vector<double> partial(B * parts * 2, 0.0);  // one slot per task: no sharing between threads
  // 16 accumulators either way: 8 rows × one vector × two outputs, or 8 rows × two vectors.
  const int64_t width = out2 || x || gt ? V : (N % (2 * V) == 0 ? 2 * V : V);
  // Small operands packed once per batch element, not per task: with fewer batch elements than threads, tasks
  // share one.
  std::vector<float> gp(B * N * Mp), gp2(out2 ? B * N * Mp : 0), gtp(gt ? 4 * B * N * Mgp : 0, 0.0f);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      pack_strips(g.data() + b * M, M, Mp, N, width, gp.data() + b * N * Mp);
      if (out2) pack_strips(g2.data() + b * M, M, Mp, N, width, gp2.data() + b * N * Mp);
      if (gt)
        for (int u = 0; u < 4; ++u) transpose_batch({(*gt)[u]}, b, Mgp, gtp.data() + (u * B + b) * N * Mgp);
    }
  });
  const auto opts = W.options();
  // x W and x S: each task adds into its own transposed copies; they are summed into the outputs after.
  std::vector<float> xw_parts(x ? 2 * B * parts * N * Mxp : 0, 0.0f);
  torch::Tensor zw = gt ? torch::empty({B, Mg, K}, opts) : torch::Tensor();
  torch::Tensor zp = gt ? torch::empty({B, Mg, K}, opts) : torch::Tensor();
  using Run = decltype(&combine_blocks<8, 1, false, false, false>);
  TORCH_CHECK(!gt || !out2, "combine: gt with out2 is not supported");
  const Run run = gt ? (x ? combine_blocks<8, 1, false, true, true> : combine_blocks<8, 1, false, false, true>)
                  : x ? (out2 ? combine_blocks<8, 1, true, true, false> : combine_blocks<8, 1, false, true, false>)
                  : out2 ? combine_blocks<8, 1, true, false, false>
                  : width == 2 * V ? combine_blocks<8, 2, false, false, false>
                                   : combine_blocks<8, 1, false, false, false>;
  at::parallel_for(0, B * parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / parts, off = b * K * N;
      const auto [k0, k1] = part_range(K, parts, t % parts, 1);
      Pass p{};
      p.out = out.data_ptr<float>() + off, p.W = W.data_ptr<float>() + off;
      p.S = S ? S->data_ptr<float>() + off : nullptr, p.P = P ? P->data_ptr<float>() + off : nullptr;
      p.Q = Q ? Q->data_ptr<float>() + off : nullptr, p.out2 = out2 ? out2->data_ptr<float>() + off : nullptr;
      p.beta = betas[b], p.c = cs[b], p.e = es[b];
      p.ap = at_.data() + b * K * Mp, p.gp = gp.data() + b * N * Mp, p.gp2 = out2 ? gp2.data() + b * N * Mp : nullptr;
      p.Mp = Mp, p.dots = partial.data() + 2 * t, p.K = K, p.N = N;
      if (x) {
        p.xt = xt.data() + b * K * Mxp, p.Mx = Mx, p.Mxp = Mxp;
        p.yw = xw_parts.data() + 2 * t * N * Mxp, p.ys = p.yw + N * Mxp;
      }
      if (gt) {
        for (int u = 0; u < 4; ++u) p.gt[u] = gtp.data() + (u * B + b) * N * Mgp;
        p.Mg = Mg, p.Mgp = Mgp, p.zw = zw.data_ptr<float>() + b * Mg * K, p.zp = zp.data_ptr<float>() + b * Mg * K;
      }
      run(p, k0, k1);
    }
  });
  torch::Tensor xw_ = x ? torch::empty({B, Mx, N}, opts) : torch::Tensor();
  torch::Tensor xs_ = x ? torch::empty({B, Mx, N}, opts) : torch::Tensor();
  if (x)
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int u = 0; u < 2; ++u) {
          float* y = (u ? xs_ : xw_).data_ptr<float>() + b * Mx * N;
          for (int64_t t = b * parts; t < (b + 1) * parts; ++t) {
            const float* own = xw_parts.data() + (2 * t + u) * N * Mxp;  // transposed: [N][Mxp]
            for (int64_t m = 0; m < Mx; ++m)
              for (int64_t k = 0; k < N; ++k)
                y[m * N + k] = t == b * parts ? own[k * Mxp + m] : y[m * N + k] + own[k * Mxp + m];
          }
        }
    });
  torch::Tensor dots;
  if (P) {
    dots = torch::zeros({B, 2}, torch::kFloat64);
    auto d = dots.accessor<double, 2>();
    for (int64_t t = 0; t < B * parts; ++t) d[t / parts][0] += partial[2 * t], d[t / parts][1] += partial[2 * t + 1];
  }
  return {dots, xw_, xs_, zw, zp};
}

#else  // no AVX-512: the module holds the chunk loop (scan.cpp) alone, which then takes the ATen products

void xw(const torch::Tensor&, const torch::Tensor&, torch::Tensor, bool) {
  TORCH_CHECK(false, "xw: the state kernels need AVX-512");
}
void xwt(const torch::Tensor&, const torch::Tensor&, torch::Tensor, bool) {
  TORCH_CHECK(false, "xwt: the state kernels need AVX-512");
}
std::vector<torch::Tensor> combine(torch::Tensor, const torch::Tensor&, const torch::Tensor&,
                                   const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                                   const RowBlocks&, const RowBlocks&, double, const c10::optional<torch::Tensor>&,
                                   const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                                   const c10::optional<RowBlocks>&, const c10::optional<torch::Tensor>&,
                                   const c10::optional<RowBlocks>&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "combine: the state kernels need AVX-512");
}

#endif  // __AVX512F__

// Like ATen's operators, the kernels release the GIL while they run: other Python threads (a data loader, a second
// model) go on meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("xw", &xw, "out (=|+=) X W", release());
  m.def("xwt", &xwt, "out (=|+=) G W^T", release());
  register_scan(m);
  m.attr("STATE_KERNELS") = kStateKernels;
  m.def("combine", &combine, "out = beta W (+ c S) + alpha A^T G; from the same reads, the dots <P, W> and <P, S>, "
        "out2 = e S + alpha A^T G2, x W and x S, gw W^T + gs S^T and gp P^T + gq Q^T", release());
}
