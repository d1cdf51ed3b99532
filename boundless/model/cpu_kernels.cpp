// CPU kernels for the decoder's fp32 hot path (AVX2 + FMA, OpenMP), called through ctypes.
//
// A matmul against weights packed once into panels of NR output features, with fused epilogues
// (bias, accumulate into the output for residual adds, SiLU(gate) * up), plus RMSNorm and RoPE.
// Built and loaded by boundless/model/native.py; every entry point has a PyTorch equivalent that
// runs when this library is unavailable.

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <algorithm>

#include "simd_math.h"

namespace {

constexpr int NR = 24;        // output features per panel: three 8-float vectors
constexpr int NR_HALF = 12;   // GLU panels: 12 gate features beside their 12 up features

inline __m256 silu256(__m256 x) {
  __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

enum Mode { STORE = 0, ACCUMULATE = 1, GLU = 2 };

// C[0:MR, 0:nvalid] (=, +=) X[0:MR, 0:K] @ panel, where the panel is [K][NR].
// GLU: columns 0..11 are gates and 12..23 ups; writes silu(gate) * up to nvalid (<= 12) columns.
template <int MR, int MODE>
inline void micro(const float* X, long ldx, const float* w, long K, const float* bias, float* C, long ldc,
                  long nvalid, const float* prefetch, long pf_step = 0) {
  __m256 c[MR][3];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++) {
#pragma GCC unroll 3
    for (int j = 0; j < 3; j++) c[i][j] = _mm256_setzero_ps();
  }
  for (long k = 0; k < K; k++) {
    if (prefetch) _mm_prefetch((const char*)(prefetch + k * pf_step), _MM_HINT_T1);
    __m256 b0 = _mm256_loadu_ps(w + k * NR);
    __m256 b1 = _mm256_loadu_ps(w + k * NR + 8);
    __m256 b2 = _mm256_loadu_ps(w + k * NR + 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      __m256 a = _mm256_broadcast_ss(X + i * ldx + k);
      c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm256_fmadd_ps(a, b2, c[i][2]);
    }
  }
  if (MODE == GLU) {
    alignas(32) float tmp[NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      _mm256_store_ps(tmp, c[i][0]);
      _mm256_store_ps(tmp + 8, c[i][1]);
      _mm256_store_ps(tmp + 16, c[i][2]);
      float* dst = C + i * ldc;
      if (bias) {
        for (int j = 0; j < NR; j++) tmp[j] += bias[j];
      }
      __m256 lo = _mm256_mul_ps(silu256(_mm256_load_ps(tmp)), _mm256_loadu_ps(tmp + NR_HALF));
      __m256 hi = _mm256_mul_ps(silu256(_mm256_loadu_ps(tmp + 4)), _mm256_loadu_ps(tmp + NR_HALF + 4));
      if (nvalid == NR_HALF) {
        _mm256_storeu_ps(dst + 4, hi);  // columns 4..11, then 0..7 (the overlap is equal)
        _mm256_storeu_ps(dst, lo);
      } else {
        alignas(32) float out[NR_HALF + 4];
        _mm256_storeu_ps(out + 4, hi);
        _mm256_storeu_ps(out, lo);
        for (long j = 0; j < nvalid; j++) dst[j] = out[j];
      }
    }
    return;
  }
  if (nvalid == NR) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
#pragma GCC unroll 3
      for (int j = 0; j < 3; j++) {
        float* dst = C + i * ldc + j * 8;
        __m256 v = c[i][j];
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j * 8));
        if (MODE == ACCUMULATE) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
        _mm256_storeu_ps(dst, v);
      }
    }
  } else {
    alignas(32) float tmp[NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      _mm256_store_ps(tmp, c[i][0]);
      _mm256_store_ps(tmp + 8, c[i][1]);
      _mm256_store_ps(tmp + 16, c[i][2]);
      float* dst = C + i * ldc;
      for (long j = 0; j < nvalid; j++) {
        float v = bias ? tmp[j] + bias[j] : tmp[j];
        dst[j] = MODE == ACCUMULATE ? dst[j] + v : v;
      }
    }
  }
}

template <int MODE>
void panel_rows(const float* X, long ldx, long M, long K, const float* w, const float* bias, float* C, long ldc,
                long nvalid, const float* next_panel) {
  // Each row group prefetches its share of the next panel (pf_step floats per k, at most a line),
  // so the loads spread over the whole panel's time instead of queueing up behind one group's.
  // Measured on decode (32 rows): 8-18% faster than the whole prefetch in the first group. Under
  // 4 rows the hardware prefetcher does better alone. Groups past the panel's NR columns' worth
  // (many rows, a step of 1) prefetch nothing.
  const long groups = M / 4;
  const long pf_step = groups > 0 ? std::min<long>((NR + groups - 1) / groups, 16) : 0;
  auto share = [&](long g) { return next_panel && g * pf_step < NR ? next_panel + g * pf_step * K : nullptr; };
  long m = 0;
  for (; m + 4 <= M; m += 4)
    micro<4, MODE>(X + m * ldx, ldx, w, K, bias, C + m * ldc, ldc, nvalid, share(m / 4), pf_step);
  switch (M - m) {
    case 3: micro<3, MODE>(X + m * ldx, ldx, w, K, bias, C + m * ldc, ldc, nvalid, nullptr); break;
    case 2: micro<2, MODE>(X + m * ldx, ldx, w, K, bias, C + m * ldc, ldc, nvalid, nullptr); break;
    case 1: micro<1, MODE>(X + m * ldx, ldx, w, K, bias, C + m * ldc, ldc, nvalid, nullptr); break;
    default: break;
  }
}

// Rows per block of the large-M loop: the block of X stays in L2 while the panels stream by.
constexpr long M_BLOCK = 192;

template <int MODE>
void gemm_impl(const float* X, long ldx, long M, long K, const float* packed, long N, const float* bias, float* C,
               long ldc, int nthreads) {
  const long width = MODE == GLU ? NR_HALF : NR;  // output columns per panel
  const long panels = (N + width - 1) / width;
  const long mblocks = (M + M_BLOCK - 1) / M_BLOCK;
  // With few rows (decode) each thread streams its own panels once; with many (prefill) the
  // work is (row block, panel) pairs, row block outermost so a block of X is reused from cache.
  const long items = panels * mblocks;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (items > 1 && nthreads > 1)
  for (long it = 0; it < items; it++) {
    long mb = it / panels, p = it % panels;
    long m0 = mb * M_BLOCK, rows = M - m0 < M_BLOCK ? M - m0 : M_BLOCK;
    long nvalid = N - p * width < width ? N - p * width : width;
    const float* w = packed + p * K * NR;
    const float* next = (p + 1 < panels && mblocks == 1) ? w + K * NR : nullptr;
    const float* b = bias ? bias + p * NR : nullptr;
    panel_rows<MODE>(X + m0 * ldx, ldx, rows, K, w, b, C + m0 * ldc + p * width, ldc, nvalid, next);
  }
}

}  // namespace

extern "C" {

int bl_abi_version() { return 2; }

// W [N, K] (row stride ldw) -> panels [ceil(N/24)][K][24], zero padded.
void bl_pack(const float* W, long ldw, long N, long K, float* out, int nthreads) {
  const long panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (long p = 0; p < panels; p++) {
    float* dst = out + p * K * NR;
    for (long k = 0; k < K; k++)
      for (long j = 0; j < NR; j++) {
        long n = p * NR + j;
        dst[k * NR + j] = n < N ? W[n * ldw + k] : 0.0f;
      }
  }
}

// Gate/up weight [2I, K] -> panels of 12 gate rows beside the 12 matching up rows.
void bl_pack_glu(const float* W, long ldw, long I, long K, float* out, int nthreads) {
  const long panels = (I + NR_HALF - 1) / NR_HALF;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (long p = 0; p < panels; p++) {
    float* dst = out + p * K * NR;
    for (long k = 0; k < K; k++)
      for (long j = 0; j < NR; j++) {
        long f = p * NR_HALF + (j % NR_HALF);
        long row = j < NR_HALF ? f : I + f;
        dst[k * NR + j] = f < I ? W[row * ldw + k] : 0.0f;
      }
  }
}

// The matching layout for a GLU bias [2I].
void bl_pack_glu_bias(const float* bias, long I, float* out) {
  const long panels = (I + NR_HALF - 1) / NR_HALF;
  for (long p = 0; p < panels; p++)
    for (long j = 0; j < NR; j++) {
      long f = p * NR_HALF + (j % NR_HALF);
      out[p * NR + j] = f < I ? bias[j < NR_HALF ? f : I + f] : 0.0f;
    }
}

// C [M, N] (row stride ldc) = X [M, K] (row stride ldx) @ W.T (+ bias), W packed by bl_pack.
// mode 0 stores, 1 adds into C, 2 (W packed by bl_pack_glu, N = I) stores silu(gate) * up.
// bias, if given, is [panels * 24] in the packed order (zero padded).
void bl_gemm(const float* X, long ldx, long M, long K, const float* packed, long N, const float* bias, float* C,
             long ldc, int mode, int nthreads) {
  if (M <= 0 || N <= 0) return;
  if (mode == ACCUMULATE)
    gemm_impl<ACCUMULATE>(X, ldx, M, K, packed, N, bias, C, ldc, nthreads);
  else if (mode == GLU)
    gemm_impl<GLU>(X, ldx, M, K, packed, N, bias, C, ldc, nthreads);
  else
    gemm_impl<STORE>(X, ldx, M, K, packed, N, bias, C, ldc, nthreads);
}

// out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), rows of H floats.
void bl_rmsnorm(const float* x, long ldx, const float* w, float* out, long ldo, long T, long H, float eps,
                int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64 && nthreads > 1)
  for (long t = 0; t < T; t++) {
    const float* xr = x + t * ldx;
    float* o = out + t * ldo;
    __m256 acc = _mm256_setzero_ps();
    long h = 0;
    for (; h + 8 <= H; h += 8) {
      __m256 v = _mm256_loadu_ps(xr + h);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float ss = 0.0f;
    for (int i = 0; i < 8; i++) ss += lanes[i];
    for (; h < H; h++) ss += xr[h] * xr[h];
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    __m256 rv = _mm256_set1_ps(r);
    h = 0;
    for (; h + 8 <= H; h += 8)
      _mm256_storeu_ps(o + h, _mm256_mul_ps(_mm256_loadu_ps(w + h), _mm256_mul_ps(_mm256_loadu_ps(xr + h), rv)));
    for (; h < H; h++) o[h] = w[h] * (xr[h] * r);
  }
}

// Rotate, in place, the leading R floats of each of the first `heads` heads of D floats of every
// row of x (row stride ldx), in the rotate-half layout within them: (x1, x2) -> (x1 cos - x2 sin,
// x2 cos + x1 sin), cos/sin [*, R/2] rows picked by positions; the other D - R floats pass (a
// partial rotary factor; R == D for most models). With q_norm_w (Qwen3), each head is first
// RMS-normalized over its D floats and scaled by q_norm_w (the first q_heads heads) or k_norm_w (the
// rest), as the model does before RoPE: one pass over the heads instead of two.
void bl_rope(float* x, long ldx, long T, long heads, long D, long R, const long* positions, const float* cos_table,
             const float* sin_table, const float* q_norm_w, const float* k_norm_w, long q_heads, float norm_eps,
             int nthreads) {
  const long half = R / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64 && nthreads > 1)
  for (long t = 0; t < T; t++) {
    const float* c = cos_table + positions[t] * half;
    const float* s = sin_table + positions[t] * half;
    for (long h = 0; h < heads; h++) {
      float* x1 = x + t * ldx + h * D;
      float* x2 = x1 + half;
      if (q_norm_w) bl_rmsnorm(x1, D, h < q_heads ? q_norm_w : k_norm_w, x1, D, 1, D, norm_eps, 1);
      long i = 0;
      for (; i + 8 <= half; i += 8) {
        __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
        __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(x1 + i, _mm256_sub_ps(_mm256_mul_ps(a, cv), _mm256_mul_ps(b, sv)));
        _mm256_storeu_ps(x2 + i, _mm256_add_ps(_mm256_mul_ps(b, cv), _mm256_mul_ps(a, sv)));
      }
      for (; i < half; i++) {
        float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
}

// A LoRA adapter's share of a projection, for its rows: out[t] += (x[t] @ A.T) @ B.T, with A [R, K] and B given
// transposed, Bt [R, N]. Rank column r of B is nonzero only in columns span[2r] to span[2r + 1] (a fused q/k/v or
// gate/up B is block-diagonal), so only those are touched. The rows are rows[0..count) (rows null: first..
// first + count), in parallel. R <= 512.
void bl_lora_add(const float* x, long ldx, const long* rows, long first, long count, const float* A, const float* Bt,
                 const long* span, long R, long K, long N, float* out, long ldo, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (count >= 2 && nthreads > 1)
  for (long i = 0; i < count; i++) {
    const long t = rows ? rows[i] : first + i;
    const float* xr = x + t * ldx;
    float* o = out + t * ldo;
    float s[512];
    for (long r = 0; r < R; r++) {
      const float* a = A + r * K;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      long k = 0;
      for (; k + 16 <= K; k += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(xr + k), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(xr + k + 8), acc1);
      }
      for (; k + 8 <= K; k += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(xr + k), acc0);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
      float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      for (; k < K; k++) sum += a[k] * xr[k];
      s[r] = sum;
    }
    for (long r = 0; r < R; r++) {
      const float* b = Bt + r * N;
      const __m256 sv = _mm256_set1_ps(s[r]);
      long n = span[2 * r];
      const long end = span[2 * r + 1];
      for (; n + 8 <= end; n += 8)
        _mm256_storeu_ps(o + n, _mm256_fmadd_ps(_mm256_loadu_ps(b + n), sv, _mm256_loadu_ps(o + n)));
      for (; n < end; n++) o[n] += b[n] * s[r];
    }
  }
}

// out[r] = the index of the first largest value of row r of x [R, N] (row stride ldx), as
// torch.argmax; -1 for a row holding a NaN (the caller then defers to torch, which ranks NaN first).
void bl_argmax_rows(const float* x, long ldx, long R, long N, long* out) {
  for (long r = 0; r < R; r++) {
    const float* row = x + r * ldx;
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    __m256 nan8 = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= N; j += 8) {
      __m256 v = _mm256_loadu_ps(row + j);
      m8 = _mm256_max_ps(m8, v);
      nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    float best = lanes[0];
    for (int i = 1; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    bool nan = _mm256_movemask_ps(nan8) != 0;
    for (; j < N; j++) {
      if (row[j] != row[j]) nan = true;
      best = row[j] > best ? row[j] : best;
    }
    long at = -1;
    if (!nan)
      for (long i = 0; i < N; i++)
        if (row[i] == best) {
          at = i;
          break;
        }
    out[r] = at;
  }
}

// The two halves of a decoder layer around attention, one call each (fewer trips through Python).
//
// Before attention: x = rmsnorm(hidden); qkv = x @ Wqkv.T (+ bias); rotate the first
// `rot_heads` heads of each qkv row in place, the leading R of their D floats (normalizing each first, with
// q_norm_w: see bl_rope). hidden, x [T, H]; qkv [T, qkv_size].
void bl_layer_in(const float* hidden, const float* norm_w, float eps, float* x, long T, long H, const float* qkv_packed,
                 const float* qkv_bias, long qkv_size, float* qkv, long rot_heads, long D, long R, const long* positions,
                 const float* cos_table, const float* sin_table, const float* q_norm_w, const float* k_norm_w,
                 long q_heads, int nthreads) {
  bl_rmsnorm(hidden, H, norm_w, x, H, T, H, eps, nthreads);
  bl_gemm(x, H, T, H, qkv_packed, qkv_size, qkv_bias, qkv, qkv_size, STORE, nthreads);
  bl_rope(qkv, qkv_size, T, rot_heads, D, R, positions, cos_table, sin_table, q_norm_w, k_norm_w, q_heads, eps,
          nthreads);
}

// After attention: hidden += attn @ Wo.T; x = rmsnorm(hidden); act = silu(x @ Wg.T) * (x @ Wu.T);
// hidden += act @ Wd.T. attn [T, A]; hidden, x [T, H]; act [T, I].
void bl_layer_out(const float* attn, long A, float* hidden, long T, long H, const float* o_packed, const float* norm_w,
                  float eps, float* x, const float* gate_up_packed, long I, float* act, const float* down_packed,
                  int nthreads) {
  bl_gemm(attn, A, T, A, o_packed, H, nullptr, hidden, H, ACCUMULATE, nthreads);
  bl_rmsnorm(hidden, H, norm_w, x, H, T, H, eps, nthreads);
  bl_gemm(x, H, T, H, gate_up_packed, I, nullptr, act, I, GLU, nthreads);
  bl_gemm(act, I, T, I, down_packed, H, nullptr, hidden, H, ACCUMULATE, nthreads);
}

}  // extern "C"
