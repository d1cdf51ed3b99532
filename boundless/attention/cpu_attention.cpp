// Paged attention partials on the CPU (fp32, AVX2 + FMA, OpenMP), called through ctypes.
//
// Reads keys and values straight from the paged cache through the block tables (no gather),
// for decodes and prefill chunks alike, and returns the partial (m, e, o) of every query row:
// m the largest scaled score, e = sum exp(score - m), o = sum exp(score - m) * v. The caller
// finishes with merge_partials, so partials computed elsewhere merge with these unchanged.
// Built and loaded by boundless/model/native.py; boundless/attention/paged.py holds the
// PyTorch path that computes the same partials.

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

namespace {

inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four dot products of q with k0..k3 (DC chunks of 8 floats), summed into one vector of 4.
template <int DC>
inline __m128 dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, long D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  const long n = DC > 0 ? DC * 8 : D;
  for (long d = 0; d < n; d += 8) {
    __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
  }
  __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
  __m256 h = _mm256_hadd_ps(h01, h23);  // lanes: (0,1,2,3) low half sums, (0,1,2,3) high half sums
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

template <int DC>
inline float dot1(const float* q, const float* k, long D) {
  __m256 a = _mm256_setzero_ps();
  const long n = DC > 0 ? DC * 8 : D;
  for (long d = 0; d < n; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
  return hsum(a);
}

struct Args {
  const float* q;
  long q_stride;  // between tokens; heads are D apart
  const float* k_cache;
  const float* v_cache;
  long num_blocks, block_size;
  const int* tables;
  long max_blocks;
  const int* q_starts;
  const int* seq_lens;
  long H, KVH, D;
  float scale;
  float* o;
  float* m;
  float* e;
};

// One query row (token t of sequence s at position pos, head h) over keys [0, pos].
template <int DC>
void attend_row(const Args& a, long s, long t, long pos, long h, float* scores) {
  const long D = DC > 0 ? DC * 8 : a.D;
  const long bs = a.block_size;
  const long kvh = h / (a.H / a.KVH);
  const int* table = a.tables + s * a.max_blocks;
  const float* q = a.q + t * a.q_stride + h * D;
  const long n = pos + 1;
  const float scale = a.scale;
  // Scores, block by block.
  float mx = -INFINITY;
  for (long b0 = 0; b0 < n; b0 += bs) {
    const long blk = table[b0 / bs];
    const float* kb = a.k_cache + ((kvh * a.num_blocks + blk) * bs) * D;
    const long cnt = n - b0 < bs ? n - b0 : bs;
    long j = 0;
    for (; j + 4 <= cnt; j += 4) {
      __m128 d4 = _mm_mul_ps(dot4<DC>(q, kb + j * D, kb + (j + 1) * D, kb + (j + 2) * D, kb + (j + 3) * D, D),
                             _mm_set1_ps(scale));
      _mm_storeu_ps(scores + b0 + j, d4);
    }
    for (; j < cnt; j++) scores[b0 + j] = dot1<DC>(q, kb + j * D, D) * scale;
    for (j = 0; j < cnt; j++) mx = scores[b0 + j] > mx ? scores[b0 + j] : mx;
  }
  // Probabilities and their sum.
  __m256 mv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  long j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
    _mm256_storeu_ps(scores + j, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  float sum = hsum(sum8);
  for (; j < n; j++) {
    float p = expf(scores[j] - mx);
    scores[j] = p;
    sum += p;
  }
  // Weighted values.
  const long row = t * a.H + h;
  float* o = a.o + row * D;
  if (DC > 0 && DC <= 8) {
    __m256 acc[DC > 0 ? DC : 1];
    for (int c = 0; c < DC; c++) acc[c] = _mm256_setzero_ps();
    for (long b0 = 0; b0 < n; b0 += bs) {
      const long blk = table[b0 / bs];
      const float* vb = a.v_cache + ((kvh * a.num_blocks + blk) * bs) * D;
      const long cnt = n - b0 < bs ? n - b0 : bs;
      for (long jj = 0; jj < cnt; jj++) {
        __m256 p = _mm256_set1_ps(scores[b0 + jj]);
        const float* v = vb + jj * D;
#pragma GCC unroll 8
        for (int c = 0; c < (DC > 0 ? DC : 1); c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c * 8), acc[c]);
      }
    }
    for (int c = 0; c < DC; c++) _mm256_storeu_ps(o + c * 8, acc[c]);
  } else {
    for (long d = 0; d < D; d++) o[d] = 0.0f;
    for (long b0 = 0; b0 < n; b0 += bs) {
      const long blk = table[b0 / bs];
      const float* vb = a.v_cache + ((kvh * a.num_blocks + blk) * bs) * D;
      const long cnt = n - b0 < bs ? n - b0 : bs;
      for (long jj = 0; jj < cnt; jj++) {
        __m256 p = _mm256_set1_ps(scores[b0 + jj]);
        const float* v = vb + jj * D;
        for (long d = 0; d < D; d += 8)
          _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
      }
    }
  }
  a.m[row] = mx;
  a.e[row] = sum;
}

template <int DC>
void run(const Args& a, long S, long tile, int nthreads) {
  // Work items: (sequence, kv head, tile of query tokens); a tile's rows share the KV in cache.
  std::vector<long> first(S + 1, 0);
  long max_ctx = 1;
  for (long s = 0; s < S; s++) {
    long ql = a.q_starts[s + 1] - a.q_starts[s];
    first[s + 1] = first[s] + a.KVH * ((ql + tile - 1) / tile);
    if (a.seq_lens[s] > max_ctx) max_ctx = a.seq_lens[s];
  }
  const long items = first[S];
  const long group = a.H / a.KVH;
#pragma omp parallel num_threads(nthreads) if (items > 1 && nthreads > 1)
  {
    std::vector<float> scores(max_ctx + 8);
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++) {
      long s = 0;
      long lo = 0, hi = S;  // the sequence whose items hold `it`
      while (hi - lo > 1) {
        long mid = (lo + hi) / 2;
        if (first[mid] <= it) lo = mid; else hi = mid;
      }
      s = lo;
      long local = it - first[s];
      long ql = a.q_starts[s + 1] - a.q_starts[s];
      long tiles = (ql + tile - 1) / tile;
      long kvh = local / tiles, ti = local % tiles;
      long t0 = ti * tile, t1 = t0 + tile < ql ? t0 + tile : ql;
      long base_pos = a.seq_lens[s] - ql;
      for (long i = t0; i < t1; i++)
        for (long g = 0; g < group; g++)
          attend_row<DC>(a, s, a.q_starts[s] + i, base_pos + i, kvh * group + g, scores.data());
    }
  }
}

}  // namespace

extern "C" {

int bl_attention_abi_version() { return 1; }

// Partials of every query token of a flat batch over its sequence's paged context.
//   q [T, H, D] (token stride q_stride, heads contiguous), caches [KVH, num_blocks, block_size, D],
//   tables [S, max_blocks] int32, q_starts [S + 1] int32 token offsets, seq_lens [S] int32 (context
//   after this step; token i of a chunk of ql sits at position seq_len - ql + i and sees keys
//   0..position). Outputs o [T, H, D], m [T, H], e [T, H].
void bl_paged_attention(const float* q, long q_stride, const float* k_cache, const float* v_cache, long num_blocks,
                        long block_size, const int* tables, long max_blocks, const int* q_starts,
                        const int* seq_lens, long S, long H, long KVH, long D, float scale, float* o, float* m,
                        float* e, long tile, int nthreads) {
  Args a{q, q_stride, k_cache, v_cache, num_blocks, block_size, tables, max_blocks, q_starts, seq_lens,
         H, KVH, D, scale, o, m, e};
  if (tile < 1) tile = 1;
  switch (D) {
    case 16: run<2>(a, S, tile, nthreads); break;
    case 32: run<4>(a, S, tile, nthreads); break;
    case 64: run<8>(a, S, tile, nthreads); break;
    case 128: run<16>(a, S, tile, nthreads); break;
    default: run<0>(a, S, tile, nthreads); break;  // any multiple of 8
  }
}

// Store new keys and values [T, KVH, D] (token strides given) at their slots of the caches
// [KVH, slots_per_head, D].
void bl_store_kv(const float* k, long k_stride, const float* v, long v_stride, float* k_cache, float* v_cache,
                 const long* slots, long T, long KVH, long slots_per_head, long D) {
  for (long t = 0; t < T; t++)
    for (long h = 0; h < KVH; h++) {
      memcpy(k_cache + (h * slots_per_head + slots[t]) * D, k + t * k_stride + h * D, D * sizeof(float));
      memcpy(v_cache + (h * slots_per_head + slots[t]) * D, v + t * v_stride + h * D, D * sizeof(float));
    }
}

}  // extern "C"
