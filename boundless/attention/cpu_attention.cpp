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

#include "../model/simd_math.h"

#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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
  bool normalize;  // write o / e (the attention output) instead of the partial's o
  // An 8-bit cache (--kv-cache-dtype fp8): k_cache and v_cache hold bytes, each the index of its value in lut (256
  // floats); a block is widened into the thread's scratch at widen_at before use. nullptr: fp32 caches.
  const float* lut = nullptr;
  long widen_at = 0;
  // A sliding window (a layer's): a query at position p sees keys p - window < j <= p. 0: the whole context.
  long window = 0;
  // Gemma 2's soft cap of the scaled scores, softcap * tanh(score / softcap), before the mask. 0: none.
  float softcap = 0.0f;
};

// softcap * tanh(x / softcap), eight at a time (a score far past the cap gives +-softcap; a NaN stays NaN).
inline __m256 softcap256(__m256 x, float softcap) {
  return _mm256_mul_ps(tanh256(_mm256_mul_ps(x, _mm256_set1_ps(1.0f / softcap))), _mm256_set1_ps(softcap));
}

// A row of ``n`` scaled scores capped in place.
inline void softcap_row(float* x, long n, float softcap) {
  long j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, softcap256(_mm256_loadu_ps(x + j), softcap));
  for (; j < n; j++) x[j] = softcap * tanhf(x[j] / softcap);
}

// The first key position a query at ``pos`` sees.
inline long window_lo(const Args& a, long pos) {
  return a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
}

// A block's bytes of an 8-bit cache as fp32, eight at a time through the type's table of values.
inline const float* widen(const float* lut, const float* block_bytes, long n, float* dst) {
  const unsigned char* src = (const unsigned char*)block_bytes;
  long i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_i32gather_ps(lut, idx, 4));
  }
  for (; i < n; i++) dst[i] = lut[src[i]];
  return dst;
}

// Where a cache block starts: a float's offset in an fp32 cache, a byte's in an 8-bit one (as a float pointer, read
// only through widen).
inline const float* block_at(const Args& a, const float* cache, long offset) {
  return a.lut ? (const float*)((const unsigned char*)cache + offset) : cache + offset;
}

// The thread's two widening buffers (keys, values) of bs * D floats, 32-byte aligned, past what the tile uses.
inline float* widen_buffer(const Args& a, float* scratch) {
  return (float*)(((size_t)(scratch + a.widen_at) + 31) & ~(size_t)31);
}

// The end of a query row: its (m, e), and o divided by e when the caller wants the output itself
// (one local partial: nothing to merge). A division, as merge_partials does, so results agree bit for bit.
inline void finish_row(const Args& a, long row, float mx, float sum) {
  a.m[row] = mx;
  a.e[row] = sum;
  if (!a.normalize) return;
  float* o = a.o + row * a.D;
  if (sum > 0.0f) {
    const __m256 ev = _mm256_set1_ps(sum);
    for (long d = 0; d < a.D; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(o + d), ev));
  } else {
    memset(o, 0, a.D * sizeof(float));
  }
}

inline void prefetch_block(const float* p, long bytes, bool to_l2) {
  const char* c = (const char*)p;
  for (long off = 0; off < bytes; off += 64) {
    if (to_l2)
      _mm_prefetch(c + off, _MM_HINT_T1);
    else
      _mm_prefetch(c + off, _MM_HINT_T0);
  }
}

// Scores of G query rows (one token, G heads of one kv head) against cnt keys of a block:
// each key chunk is loaded once for the G rows, four keys at a time.
template <int DC, int G>
inline void qk_block(const float* const* q, const float* kb, long cnt, long D, float scale, float* const* sc) {
  const long n = DC > 0 ? DC * 8 : D;
  const __m128 sv = _mm_set1_ps(scale);
  long j = 0;
  for (; j + 4 <= cnt; j += 4) {
    const float* k0 = kb + j * n;
    __m256 acc[G][4];
#pragma GCC unroll 3
    for (int r = 0; r < G; r++)
#pragma GCC unroll 4
      for (int t = 0; t < 4; t++) acc[r][t] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (long d = 0; d < n; d += 8) {
      __m256 kv[4];
#pragma GCC unroll 4
      for (int t = 0; t < 4; t++) kv[t] = _mm256_loadu_ps(k0 + t * n + d);
#pragma GCC unroll 3
      for (int r = 0; r < G; r++) {
        __m256 qv = _mm256_loadu_ps(q[r] + d);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) acc[r][t] = _mm256_fmadd_ps(qv, kv[t], acc[r][t]);
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < G; r++) {
      __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
      __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(sc[r] + j, _mm_mul_ps(s4, sv));
    }
  }
  for (; j < cnt; j++)
#pragma GCC unroll 3
    for (int r = 0; r < G; r++) sc[r][j] = dot1<DC>(q[r], kb + j * n, D) * scale;
}

// o[r] = o[r] * alpha[r] + sum_j p[r][j] * v_j (alpha 0: o[r] starts from zero, whatever it held).
template <int DC, int G>
inline void pv_block_scaled(const float* const* p, const float* vb, long cnt, float* const* o, const float* alpha) {
  static_assert(DC > 0, "specialized head sizes only");
  constexpr int CW = DC >= 4 ? 4 : DC;  // 8-float chunks per pass
  for (int c0 = 0; c0 < DC; c0 += CW) {
    __m256 acc[G][CW];
#pragma GCC unroll 3
    for (int r = 0; r < G; r++) {
      const __m256 av = _mm256_set1_ps(alpha[r]);
#pragma GCC unroll 4
      for (int c = 0; c < CW; c++)
        acc[r][c] = alpha[r] == 0.0f ? _mm256_setzero_ps() : _mm256_mul_ps(_mm256_loadu_ps(o[r] + (c0 + c) * 8), av);
    }
    for (long j = 0; j < cnt; j++) {
      const float* v = vb + j * DC * 8 + c0 * 8;
      __m256 vv[CW];
#pragma GCC unroll 4
      for (int c = 0; c < CW; c++) vv[c] = _mm256_loadu_ps(v + c * 8);
#pragma GCC unroll 3
      for (int r = 0; r < G; r++) {
        const __m256 pj = _mm256_broadcast_ss(p[r] + j);
#pragma GCC unroll 4
        for (int c = 0; c < CW; c++) acc[r][c] = _mm256_fmadd_ps(pj, vv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < G; r++)
#pragma GCC unroll 4
      for (int c = 0; c < CW; c++) _mm256_storeu_ps(o[r] + (c0 + c) * 8, acc[r][c]);
  }
}

// o[r] += sum_j p[r][j] * v_j over cnt values of a block, for G rows sharing the values.
template <int DC, int G>
inline void pv_block(const float* const* p, const float* vb, long cnt, long D, float* const* o) {
  if constexpr (DC > 0) {
    float ones[G];
    for (int r = 0; r < G; r++) ones[r] = 1.0f;
    pv_block_scaled<DC, G>(p, vb, cnt, o, ones);
  } else {
    for (int r = 0; r < G; r++)
      for (long j = 0; j < cnt; j++) {
        __m256 pr = _mm256_set1_ps(p[r][j]);
        const float* v = vb + j * D;
        for (long d = 0; d < D; d += 8)
          _mm256_storeu_ps(o[r] + d, _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o[r] + d)));
      }
  }
}

// Query rows (tokens t0..t1 of sequence s, the heads of kv head kvh) over their causal context,
// in one pass over the context's blocks with a running (online) softmax: each key block and its
// value block are read once for all the tile's rows, and the heads of one token (which see the
// same keys) go through each block together. While a block is in use the next one is prefetched.
template <int DC>
void attend_tile(const Args& a, long s, long kvh, long t0, long t1, float* scratch) {
  const long D = DC > 0 ? DC * 8 : a.D;
  const long bs = a.block_size;
  const long group = a.H / a.KVH;
  const long ql = a.q_starts[s + 1] - a.q_starts[s];
  const long base = a.seq_lens[s] - ql;  // position of the chunk's first token
  const long tok0 = a.q_starts[s];
  const int* table = a.tables + s * a.max_blocks;
  const long n_all = base + t1;  // keys any row of the tile sees
  const long block_bytes = bs * D * (a.lut ? 1 : (long)sizeof(float));
  auto kblock = [&](long b) { return block_at(a, a.k_cache, ((kvh * a.num_blocks + table[b]) * bs) * D); };
  auto vblock = [&](long b) { return block_at(a, a.v_cache, ((kvh * a.num_blocks + table[b]) * bs) * D); };
  float* wk = a.lut ? widen_buffer(a, scratch) : nullptr;
  const long nblocks = (n_all + bs - 1) / bs;
  const long rows = (t1 - t0) * group;
  // Row r = (token t0 + r / group, head kvh * group + r % group).
  auto qrow = [&](long i, long g) { return a.q + (tok0 + i) * a.q_stride + (kvh * group + g) * D; };
  auto orow = [&](long i, long g) { return a.o + ((tok0 + i) * a.H + kvh * group + g) * D; };
  float* mx = scratch;                  // [rows] running max
  float* sum = scratch + rows;          // [rows] running sum of exp(score - max)
  float* sc = scratch + 2 * rows;       // [rows][bs] this block's scores, then probabilities
  for (long r = 0; r < rows; r++) {
    mx[r] = -INFINITY;
    sum[r] = 0.0f;
  }
  for (long i = t0; i < t1; i++)
    for (long g = 0; g < group; g++) memset(orow(i, g), 0, D * sizeof(float));
  const long first_block = window_lo(a, base + t0) / bs;  // blocks before it lie outside every row's window
  prefetch_block(kblock(first_block), block_bytes, false);
  prefetch_block(vblock(first_block), block_bytes, false);
  for (long b = first_block; b < nblocks; b++) {
    const long b0 = b * bs;
    const float* kb = a.lut ? widen(a.lut, kblock(b), bs * D, wk) : kblock(b);
    const float* vb = a.lut ? widen(a.lut, vblock(b), bs * D, wk + bs * D) : vblock(b);
    if (b + 1 < nblocks) {
      prefetch_block(kblock(b + 1), block_bytes, false);
      prefetch_block(vblock(b + 1), block_bytes, false);
    }
    for (long i = t0; i < t1; i++) {
      long cnt = base + i + 1 - b0;  // keys of this block token i sees: [skip, skip + cnt) of it
      if (cnt > bs) cnt = bs;
      long skip = window_lo(a, base + i) - b0;
      if (skip < 0) skip = 0;
      cnt -= skip;
      if (cnt <= 0) continue;
      const float* kbi = kb + skip * D;
      const float* vbi = vb + skip * D;
      for (long g = 0; g < group;) {
        const long take = group - g >= 3 ? 3 : group - g;
        const long r0 = (i - t0) * group + g;
        const float* q[3];
        float* srow[3];
        const float* prow[3];
        float* o[3];
        for (long r = 0; r < take; r++) {
          q[r] = qrow(i, g + r);
          srow[r] = sc + (r0 + r) * bs;
          prow[r] = srow[r];
          o[r] = orow(i, g + r);
        }
        if (take == 3)
          qk_block<DC, 3>(q, kbi, cnt, D, a.scale, srow);
        else if (take == 2)
          qk_block<DC, 2>(q, kbi, cnt, D, a.scale, srow);
        else
          qk_block<DC, 1>(q, kbi, cnt, D, a.scale, srow);
        // Online softmax: rescale what the row holds to the new max, add this block's share.
        for (long r = 0; r < take; r++) {
          float* x = srow[r];
          if (a.softcap > 0.0f) softcap_row(x, cnt, a.softcap);
          float m_blk = x[0];
          for (long j = 1; j < cnt; j++) m_blk = x[j] > m_blk ? x[j] : m_blk;
          const float m_old = mx[r0 + r];
          const float m_new = m_blk > m_old ? m_blk : m_old;
          float block_sum = 0.0f;
          long j = 0;
          const __m256 mv = _mm256_set1_ps(m_new);
          __m256 s8 = _mm256_setzero_ps();
          for (; j + 8 <= cnt; j += 8) {
            __m256 pv = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
            _mm256_storeu_ps(x + j, pv);
            s8 = _mm256_add_ps(s8, pv);
          }
          block_sum = hsum(s8);
          for (; j < cnt; j++) {
            x[j] = expf(x[j] - m_new);
            block_sum += x[j];
          }
          if (m_new > m_old && m_old != -INFINITY) {
            const float alpha = expf(m_old - m_new);
            const __m256 av = _mm256_set1_ps(alpha);
            for (long d = 0; d < D; d += 8) _mm256_storeu_ps(o[r] + d, _mm256_mul_ps(_mm256_loadu_ps(o[r] + d), av));
            sum[r0 + r] *= alpha;
          }
          sum[r0 + r] += block_sum;
          mx[r0 + r] = m_new;
        }
        if (take == 3)
          pv_block<DC, 3>(prow, vbi, cnt, D, o);
        else if (take == 2)
          pv_block<DC, 2>(prow, vbi, cnt, D, o);
        else
          pv_block<DC, 1>(prow, vbi, cnt, D, o);
        g += take;
      }
    }
  }
  for (long i = t0; i < t1; i++)
    for (long g = 0; g < group; g++)
      finish_row(a, (tok0 + i) * a.H + kvh * group + g, mx[(i - t0) * group + g], sum[(i - t0) * group + g]);
}

// dst[i][j] = src[j][i] for an 8 x 8 tile (row strides in floats).
inline void transpose8(const float* src, long ld_src, float* dst, long ld_dst) {
  __m256 r0 = _mm256_loadu_ps(src + 0 * ld_src), r1 = _mm256_loadu_ps(src + 1 * ld_src);
  __m256 r2 = _mm256_loadu_ps(src + 2 * ld_src), r3 = _mm256_loadu_ps(src + 3 * ld_src);
  __m256 r4 = _mm256_loadu_ps(src + 4 * ld_src), r5 = _mm256_loadu_ps(src + 5 * ld_src);
  __m256 r6 = _mm256_loadu_ps(src + 6 * ld_src), r7 = _mm256_loadu_ps(src + 7 * ld_src);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(dst + 0 * ld_dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ld_dst, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ld_dst, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ld_dst, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ld_dst, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ld_dst, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ld_dst, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ld_dst, _mm256_permute2f128_ps(u3, u7, 0x31));
}

template <int DC, int NB8>
void attend_tile_wide_impl(const Args& a, long s, long kvh, long t0, long t1, float* scratch);

template <int DC, int NB8>
void attend_tile_wide(const Args& a, long s, long kvh, long t0, long t1, float* scratch) {
  if constexpr (DC > 0) attend_tile_wide_impl<DC, NB8>(a, s, kvh, t0, t1, scratch);
}

// Prefill tiles (many query rows per key block): the key block is transposed once into
// kt[D][bs] so that each row's scores come out as bs/8 vectors with no horizontal sums; the
// softmax runs on those vectors, and the value pass folds the rescaling of earlier blocks into
// its loads. NB8 = block_size / 8 (1, 2 or 4).
template <int DC, int NB8>
void attend_tile_wide_impl(const Args& a, long s, long kvh, long t0, long t1, float* scratch) {
  constexpr int BS = NB8 * 8;
  constexpr int RG = 8 / NB8;  // rows per score pass: RG * NB8 = 8 accumulators
  const long D = DC > 0 ? DC * 8 : a.D;
  const long group = a.H / a.KVH;
  const long ql = a.q_starts[s + 1] - a.q_starts[s];
  const long base = a.seq_lens[s] - ql;
  const long tok0 = a.q_starts[s];
  const int* table = a.tables + s * a.max_blocks;
  const long n_all = base + t1;
  const long nblocks = (n_all + BS - 1) / BS;
  const long rows = (t1 - t0) * group;
  float* mx = scratch;              // [rows]
  float* sum = mx + rows;           // [rows]
  float* alpha = sum + rows;        // [rows] rescale of what the row held before this block
  float* pr = alpha + rows;         // [rows][BS] probabilities of this block
  float* kt = pr + rows * BS;       // [D][BS] the key block, transposed (32-byte aligned by the caller)
  kt = (float*)(((size_t)kt + 31) & ~(size_t)31);
  for (long r = 0; r < rows; r++) {
    mx[r] = -INFINITY;
    sum[r] = 0.0f;
  }
  const float scale = a.scale;
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  auto row_q = [&](long r) { return a.q + (tok0 + t0 + r / group) * a.q_stride + (kvh * group + r % group) * D; };
  auto row_o = [&](long r) { return a.o + ((tok0 + t0 + r / group) * a.H + kvh * group + r % group) * D; };
  auto row_lo_of = [&](long r, long b0) {  // the first key of the block starting at b0 in row r's window
    long lo = window_lo(a, base + t0 + r / group) - b0;
    return lo < 0 ? 0 : (lo > BS ? BS : lo);
  };
  auto row_cnt = [&](long r, long b0) {  // keys of the block starting at b0 that row r sees: [row_lo, row_cnt)
    long c = base + t0 + r / group + 1 - b0;
    c = c < 0 ? 0 : (c > BS ? BS : c);
    return c <= row_lo_of(r, b0) ? 0 : c;  // (none when its window starts past them)
  };
  float* wk = a.lut ? widen_buffer(a, scratch) : nullptr;
  const long block_bytes = BS * D * (a.lut ? 1 : 4);
  for (long b = window_lo(a, base + t0) / BS; b < nblocks; b++) {  // (blocks before: outside every row's window)
    const long b0 = b * BS;
    const float* kb = block_at(a, a.k_cache, ((kvh * a.num_blocks + table[b]) * BS) * D);
    const float* vb = block_at(a, a.v_cache, ((kvh * a.num_blocks + table[b]) * BS) * D);
    if (a.lut) {
      kb = widen(a.lut, kb, BS * D, wk);
      vb = widen(a.lut, vb, BS * D, wk + BS * D);
    }
    if (b + 1 < nblocks) {
      prefetch_block(block_at(a, a.k_cache, ((kvh * a.num_blocks + table[b + 1]) * BS) * D), block_bytes, false);
      prefetch_block(block_at(a, a.v_cache, ((kvh * a.num_blocks + table[b + 1]) * BS) * D), block_bytes, false);
    }
    for (long j0 = 0; j0 < BS; j0 += 8)
      for (long d0 = 0; d0 < D; d0 += 8) transpose8(kb + j0 * D + d0, D, kt + d0 * BS + j0, BS);
    // Scores and the online softmax, RG rows at a time.
    for (long r0 = 0; r0 < rows; r0 += RG) {
      const long nr = rows - r0 < RG ? rows - r0 : RG;
      bool none = true;  // (rows in position order: the causal limit and the window start both grow down them)
      for (long r = r0; r < r0 + nr && none; r++) none = row_cnt(r, b0) == 0;
      if (none) {
        for (long r = r0; r < r0 + nr; r++) {
          alpha[r] = 1.0f;
          memset(pr + r * BS, 0, BS * sizeof(float));
        }
        continue;
      }
      __m256 acc[RG][NB8];
      const float* q[RG];
      for (int r = 0; r < RG; r++) {
        q[r] = row_q(r0 + (r < nr ? r : 0));
        for (int c = 0; c < NB8; c++) acc[r][c] = _mm256_setzero_ps();
      }
      for (long d = 0; d < D; d++) {
        __m256 kv[NB8];
#pragma GCC unroll 4
        for (int c = 0; c < NB8; c++) kv[c] = _mm256_load_ps(kt + d * BS + c * 8);
#pragma GCC unroll 8
        for (int r = 0; r < RG; r++) {
          __m256 qv = _mm256_broadcast_ss(q[r] + d);
#pragma GCC unroll 4
          for (int c = 0; c < NB8; c++) acc[r][c] = _mm256_fmadd_ps(qv, kv[c], acc[r][c]);
        }
      }
      alignas(32) float sc[RG][BS];
#pragma GCC unroll 8
      for (int r = 0; r < RG; r++)
#pragma GCC unroll 4
        for (int c = 0; c < NB8; c++) _mm256_store_ps(sc[r] + c * 8, acc[r][c]);
      for (long r = 0; r < nr; r++) {
        const long row = r0 + r;
        const long cnt = row_cnt(row, b0);
        if (cnt == 0) {
          alpha[row] = 1.0f;
          memset(pr + row * BS, 0, BS * sizeof(float));
          continue;
        }
        const long lo = row_lo_of(row, b0);
        __m256 sv[NB8];
        __m256 m8 = neg_inf;
        for (int c = 0; c < NB8; c++) {
          __m256 x = _mm256_mul_ps(_mm256_load_ps(sc[r] + c * 8), _mm256_set1_ps(scale));
          if (a.softcap > 0.0f) x = softcap256(x, a.softcap);  // (before the masks: tanh would lift their -inf)
          if (cnt < BS) {
            __m256 lim = _mm256_set1_ps((float)(cnt - c * 8));
            x = _mm256_blendv_ps(neg_inf, x, _mm256_cmp_ps(iota, lim, _CMP_LT_OQ));
          }
          if (lo > 0) {  // keys before the row's window
            __m256 start = _mm256_set1_ps((float)(lo - c * 8));
            x = _mm256_blendv_ps(neg_inf, x, _mm256_cmp_ps(iota, start, _CMP_GE_OQ));
          }
          sv[c] = x;
          m8 = _mm256_max_ps(m8, x);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float m_blk = _mm_cvtss_f32(m4);
        const float m_old = mx[row];
        const float m_new = m_blk > m_old ? m_blk : m_old;
        const float al = m_old == -INFINITY ? 0.0f : (m_new > m_old ? expf(m_old - m_new) : 1.0f);
        const __m256 mv = _mm256_set1_ps(m_new);
        __m256 s8 = _mm256_setzero_ps();
        for (int c = 0; c < NB8; c++) {
          __m256 p = exp256(_mm256_sub_ps(sv[c], mv));
          _mm256_storeu_ps(pr + row * BS + c * 8, p);
          s8 = _mm256_add_ps(s8, p);
        }
        sum[row] = sum[row] * al + hsum(s8);
        mx[row] = m_new;
        alpha[row] = al;
      }
    }
    // Values: o = o * alpha + p @ V, three rows sharing each value load.
    for (long r0 = 0; r0 < rows; r0 += 3) {
      const long nr = rows - r0 < 3 ? rows - r0 : 3;
      long cnt = 0;
      for (long r = r0; r < r0 + nr; r++) cnt = row_cnt(r, b0) > cnt ? row_cnt(r, b0) : cnt;
      if (cnt == 0) continue;
      const float* p[3];
      float* o[3];
      float al[3];
      for (long r = 0; r < nr; r++) {
        p[r] = pr + (r0 + r) * BS;
        o[r] = row_o(r0 + r);
        al[r] = alpha[r0 + r];
      }
      if (nr == 3)
        pv_block_scaled<DC, 3>(p, vb, cnt, o, al);
      else if (nr == 2)
        pv_block_scaled<DC, 2>(p, vb, cnt, o, al);
      else
        pv_block_scaled<DC, 1>(p, vb, cnt, o, al);
    }
  }
  for (long r = 0; r < rows; r++) finish_row(a, (tok0 + t0 + r / group) * a.H + kvh * group + r % group, mx[r], sum[r]);
}

template <int DC>
void run(const Args& given, long S, long tile, int nthreads) {
  Args a = given;
  // Work items: (sequence, kv head, tile of query tokens); a tile's rows share the KV in cache.
  std::vector<long> first(S + 1, 0);
  for (long s = 0; s < S; s++) {
    long ql = a.q_starts[s + 1] - a.q_starts[s];
    first[s + 1] = first[s] + a.KVH * ((ql + tile - 1) / tile);
  }
  const long items = first[S];
  const long group = a.H / a.KVH;
  const long rows = tile * group;
  const long bs = a.block_size;
  const bool wide = DC > 0 && rows >= 6 && (bs == 8 || bs == 16 || bs == 32);
  a.widen_at = rows * (3 + bs) + a.D * bs + 16;  // past both tile kinds' scratch
#pragma omp parallel num_threads(nthreads) if (items > 1 && nthreads > 1)
  {
    std::vector<float> scratch(a.widen_at + (a.lut ? 2 * bs * a.D + 16 : 0));
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++) {
      long lo = 0, hi = S;  // the sequence whose items hold `it`
      while (hi - lo > 1) {
        long mid = (lo + hi) / 2;
        if (first[mid] <= it)
          lo = mid;
        else
          hi = mid;
      }
      const long s = lo;
      const long local = it - first[s];
      const long ql = a.q_starts[s + 1] - a.q_starts[s];
      const long tiles = (ql + tile - 1) / tile;
      const long kvh = local / tiles, ti = local % tiles;
      const long t0 = ti * tile, t1 = t0 + tile < ql ? t0 + tile : ql;
      if (DC == 0 || !wide || (t1 - t0) * group < 6)
        attend_tile<DC>(a, s, kvh, t0, t1, scratch.data());
      else if (bs == 16)
        attend_tile_wide<DC, 2>(a, s, kvh, t0, t1, scratch.data());
      else if (bs == 8)
        attend_tile_wide<DC, 1>(a, s, kvh, t0, t1, scratch.data());
      else
        attend_tile_wide<DC, 4>(a, s, kvh, t0, t1, scratch.data());
    }
  }
}

// The kernel specialized for the head size (a.D): 16, 32, 64 and 128 unrolled, any other multiple of 8 generic.
void run_for_head_size(const Args& a, long S, long tile, int nthreads) {
  if (tile < 1) tile = 1;
  switch (a.D) {
    case 16: run<2>(a, S, tile, nthreads); break;
    case 32: run<4>(a, S, tile, nthreads); break;
    case 64: run<8>(a, S, tile, nthreads); break;
    case 128: run<16>(a, S, tile, nthreads); break;
    default: run<0>(a, S, tile, nthreads); break;  // any multiple of 8
  }
}

}  // namespace

extern "C" {

int bl_attention_abi_version() { return 5; }

// Partials of every query token of a flat batch over its sequence's paged context.
//   q [T, H, D] (token stride q_stride, heads contiguous), caches [KVH, num_blocks, block_size, D],
//   tables [S, max_blocks] int32, q_starts [S + 1] int32 token offsets, seq_lens [S] int32 (context
//   after this step; token i of a chunk of ql sits at position seq_len - ql + i and sees keys
//   0..position, or with window > 0 position - window + 1..position; with softcap > 0 each scaled score capped,
//   softcap * tanh(score / softcap)). Outputs o [T, H, D], m [T, H], e [T, H]; with normalize, o holds o / e.
void bl_paged_attention(const float* q, long q_stride, const float* k_cache, const float* v_cache, long num_blocks,
                        long block_size, const int* tables, long max_blocks, const int* q_starts,
                        const int* seq_lens, long S, long H, long KVH, long D, float scale, float* o, float* m,
                        float* e, long tile, int normalize, int nthreads, long window, float softcap) {
  Args a{q, q_stride, k_cache, v_cache, num_blocks, block_size, tables, max_blocks, q_starts, seq_lens,
         H, KVH, D, scale, o, m, e, normalize != 0};
  a.window = window;
  a.softcap = softcap;
  run_for_head_size(a, S, tile, nthreads);
}

// bl_paged_attention over 8-bit caches: each byte the index of its value in lut [256].
void bl_paged_attention8(const float* q, long q_stride, const unsigned char* k_cache, const unsigned char* v_cache,
                         long num_blocks, long block_size, const int* tables, long max_blocks, const int* q_starts,
                         const int* seq_lens, long S, long H, long KVH, long D, float scale, float* o, float* m,
                         float* e, long tile, int normalize, int nthreads, long window, float softcap,
                         const float* lut) {
  Args a{q, q_stride, (const float*)k_cache, (const float*)v_cache, num_blocks, block_size, tables, max_blocks,
         q_starts, seq_lens, H, KVH, D, scale, o, m, e, normalize != 0, lut};
  a.window = window;
  a.softcap = softcap;
  run_for_head_size(a, S, tile, nthreads);
}

// Store new keys and values [T, KVH, D] (token strides given) at their slots of the caches
// [KVH, slots_per_head, D].
void bl_store_kv(const float* k, long k_stride, const float* v, long v_stride, float* k_cache, float* v_cache,
                 const long* slots, long T, long KVH, long slots_per_head, long D);

// bl_store_kv then bl_paged_attention: a layer's whole attention in one call.
void bl_store_and_attend(const float* k, long k_stride, const float* v, long v_stride, const long* slots, long T,
                         const float* q, long q_stride, float* k_cache, float* v_cache, long num_blocks,
                         long block_size, const int* tables, long max_blocks, const int* q_starts, const int* seq_lens,
                         long S, long H, long KVH, long D, float scale, float* o, float* m, float* e, long tile,
                         int normalize, int nthreads, long window, float softcap) {
  bl_store_kv(k, k_stride, v, v_stride, k_cache, v_cache, slots, T, KVH, num_blocks * block_size, D);
  bl_paged_attention(q, q_stride, k_cache, v_cache, num_blocks, block_size, tables, max_blocks, q_starts, seq_lens, S,
                     H, KVH, D, scale, o, m, e, tile, normalize, nthreads, window, softcap);
}

void bl_store_kv(const float* k, long k_stride, const float* v, long v_stride, float* k_cache, float* v_cache,
                 const long* slots, long T, long KVH, long slots_per_head, long D) {
  for (long t = 0; t < T; t++)
    for (long h = 0; h < KVH; h++) {
      memcpy(k_cache + (h * slots_per_head + slots[t]) * D, k + t * k_stride + h * D, D * sizeof(float));
      memcpy(v_cache + (h * slots_per_head + slots[t]) * D, v + t * v_stride + h * D, D * sizeof(float));
    }
}

}  // extern "C"
