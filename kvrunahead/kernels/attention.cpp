// Attention on the CPU with its log-sum-exp, for every shape the engine runs.
//
// One call takes a batch of query rows, each a run of consecutive positions in one batch entry of q, and for each
// row a list of key/value pieces read in place (a chain's received prefix then the rank's own tokens, a request's
// cache, a fork's shared prompt then its own tokens). A key is visible to a query by position: causal (key <=
// query) with any offset, within a sliding window (query - key < window), or every key (full). No mask is ever
// materialised. The query heads of one K,V head are attended together, so every K,V load serves all of them (GQA,
// MQA). Scores, softmax and accumulation are float32; inputs are float32 or bfloat16.
//
// Prefill rows (kTileMinPositions query positions or more) take the tile path where it is on: the K,V a call reads
// are packed once into blocks, and each work item (row, K,V head, up to kTileRows query vectors) multiplies Q.K^T
// and P.V with ATen's batch-reduce GEMM (cpublas::brgemm: AMX tiles where the CPU has them, oneDNN's AVX-512 or
// AVX2 micro-kernels elsewhere), its online softmax between them in AVX2.
//
// The other rows (decode, a few positions), and every row where the tile path is off, take the vector path: the
// work item is (row, K,V head, block of query positions). Its queries are packed transposed once (Qt), and each
// block of keys is scored as S^T[key][query] with the keys broadcast from the cache in place, so the online
// softmax's maxima and sums run down the columns as plain vector operations. bfloat16 multiplies in pairs with
// AVX-512-BF16's vdpbf16ps (the probabilities rounded to bfloat16 for P.V, as every bf16 flash kernel does, and as
// the tile path does too); float32 with AVX-512 FMA. AVX2 hosts (and head sizes not a multiple of 16) run the same
// layout in 8-lane FMA, bfloat16 widened to float32 per block; head sizes not a multiple of 8 run the portable
// loop. The instruction set is chosen at run time (KVR_ATTENTION_ISA forces one, KVR_ATTENTION_TILES=0|1 the tile
// path off or on, for tests).
//
// Where the vector path has fewer work items than twice the threads (a decode step of a few rows after a long
// prompt: one row of SmolLM2 is 3 items), each long row's keys are split into parts of at least kSplitMinKeys, each
// part a row of its own writing float32 and its log-sum-exp into scratch, and the parts are merged by their
// log-sum-exp (flash-decoding's split): one 16k row keeps every thread busy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvr {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kBlockKeys = 64;   // keys scored per block (even: bf16 multiplies key pairs)
constexpr int kTargetRows = 96;  // query vectors (positions x grouped heads) per work item
constexpr int kSplitMinKeys = 512;  // a row's keys split across threads only in parts of at least this many
constexpr int kMaxKeyParts = 8;

using bf16 = uint16_t;

struct Row {
  int64_t b, q_lo, q_hi, q_pos, piece_lo, piece_hi;
};

struct Piece {
  int64_t t, b, k_lo, k_hi, k_pos;
};

struct Strided {  // [B, H, N, D], D contiguous
  const char* data;
  int64_t sb, sh, sn;  // element strides
  int elem;
  const void* at(int64_t b, int64_t h, int64_t n) const {
    return data + (b * sb + h * sh + n * sn) * elem;
  }
};

struct Problem {
  int64_t d, heads, kv_heads, group;
  bool causal, bf16_in, out_f32;
  int64_t window;
  float scale;
  Strided q;
  std::vector<Strided> k, v;
  std::vector<Row> rows;
  std::vector<Piece> pieces;
  char* out;  // [B, n, heads, d] of float32 or the input dtype
  int64_t out_sb, out_sn;
  float* lse;  // [B, heads, n]
  int64_t lse_sb, lse_n;
};

struct Item {
  int64_t row, h, i0, npos;
};

static inline float bf16_to_f32(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline bf16 f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

// The span of key indices [lo, hi) of a piece any of positions [qa, qb] can see.
static inline void visible_span(const Problem& p, const Piece& pc, int64_t qa, int64_t qb, int64_t* lo,
                                int64_t* hi) {
  int64_t a = pc.k_lo, e = pc.k_hi;
  if (p.causal) e = std::min(e, pc.k_lo + (qb - pc.k_pos) + 1);
  if (p.window > 0) a = std::max(a, pc.k_lo + (qa - p.window + 1 - pc.k_pos));
  *lo = a;
  *hi = std::max(a, e);
}

// Whether every key position in [ka, kb] is visible to every query position in [qa, qb].
static inline bool all_visible(const Problem& p, int64_t ka, int64_t kb, int64_t qa, int64_t qb) {
  if (p.causal && kb > qa) return false;
  if (p.window > 0 && ka <= qb - p.window) return false;
  return true;
}

static inline bool visible(const Problem& p, int64_t kpos, int64_t qpos) {
  if (p.causal && kpos > qpos) return false;
  if (p.window > 0 && kpos <= qpos - p.window) return false;
  return true;
}

static void write_result(const Problem& p, const Item& it, const float* o, int64_t ldo, const float* m,
                         const float* l) {
  const Row& r = p.rows[it.row];
  const int64_t g = p.group, d = p.d;
  for (int64_t i = 0; i < it.npos * g; ++i) {
    const int64_t pos = it.i0 + i / g, head = it.h * g + i % g;
    const int64_t n = r.q_lo + pos;
    const bool none = !(l[i] > 0.f);
    const float inv = none ? 0.f : 1.f / l[i];
    p.lse[r.b * p.lse_sb + head * p.lse_n + n] = none ? kNegInf : m[i] * kLn2 + std::log(l[i]);
    char* dst = p.out + (r.b * p.out_sb + n * p.out_sn + head * d) * (p.out_f32 ? 4 : (p.bf16_in ? 2 : 4));
    if (p.out_f32 || !p.bf16_in) {
      float* f = reinterpret_cast<float*>(dst);
      for (int64_t c = 0; c < d; ++c) f[c] = o[i * ldo + c] * inv;
    } else {
      bf16* f = reinterpret_cast<bf16*>(dst);
      for (int64_t c = 0; c < d; ++c) f[c] = f32_to_bf16(o[i * ldo + c] * inv);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The portable path: any head size, float32 or bfloat16, the same blocking, plain loops the compiler vectorises.

template <typename T>
static inline float load_f(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return x[i];
  } else {
    return bf16_to_f32(x[i]);
  }
}

// body(ka, nk) for each block of up to kBlockKeys keys of a row's pieces that positions [qa, qb] can see, with krow
// and vrow pointing at the block's rows and ka the block's first key position. A block spans pieces whose visible
// keys follow each other in position (a paged row's runs of 16-position blocks fill whole blocks of kBlockKeys, not
// one short block per run); the rows after a full block in its last piece are prefetched while it is worked on (a
// long row is read from memory, not cache).
template <typename T, typename F>
static inline void each_key_block(const Problem& p, const Row& r, int64_t h, int64_t qa, int64_t qb, const T** krow,
                                  const T** vrow, F&& body) {
  int64_t nk = 0, ka = 0;
  for (int64_t pi = r.piece_lo; pi < r.piece_hi; ++pi) {
    const Piece& pc = p.pieces[pi];
    int64_t lo, hi;
    visible_span(p, pc, qa, qb, &lo, &hi);
    if (lo >= hi) continue;
    if (nk > 0 && pc.k_pos + (lo - pc.k_lo) != ka + nk) {  // not the next position: the block ends here
      body(ka, nk);
      nk = 0;
    }
    const Strided& K = p.k[pc.t];
    const Strided& V = p.v[pc.t];
    for (int64_t j0 = lo; j0 < hi;) {
      if (nk == 0) ka = pc.k_pos + (j0 - pc.k_lo);
      const int64_t take = std::min<int64_t>(kBlockKeys - nk, hi - j0);
      for (int64_t j = 0; j < take; ++j) {
        krow[nk + j] = static_cast<const T*>(K.at(pc.b, h, j0 + j));
        vrow[nk + j] = static_cast<const T*>(V.at(pc.b, h, j0 + j));
      }
      nk += take;
      j0 += take;
      if (nk < kBlockKeys) continue;
      const int64_t next = std::min<int64_t>(kBlockKeys, hi - j0);
      for (int64_t j = 0; j < next; ++j) {
        const char* kr = static_cast<const char*>(K.at(pc.b, h, j0 + j));
        const char* vr = static_cast<const char*>(V.at(pc.b, h, j0 + j));
        for (int64_t off = 0; off < p.d * static_cast<int64_t>(sizeof(T)); off += 64) {
          _mm_prefetch(kr + off, _MM_HINT_T0);
          _mm_prefetch(vr + off, _MM_HINT_T0);
        }
      }
      body(ka, nk);
      nk = 0;
    }
  }
  if (nk > 0) body(ka, nk);
}

template <typename T>
static void portable_item(const Problem& p, const Item& it) {
  const Row& r = p.rows[it.row];
  const int64_t g = p.group, d = p.d, mrows = it.npos * g;
  const float c = p.scale * kLog2e;
  thread_local std::vector<float> qbuf, obuf, ml, sbuf;
  thread_local std::vector<const T*> krow, vrow;
  krow.resize(kBlockKeys);
  vrow.resize(kBlockKeys);
  qbuf.assign(mrows * d, 0.f);
  obuf.assign(mrows * d, 0.f);
  ml.assign(2 * mrows, 0.f);
  sbuf.resize(kBlockKeys);
  float* m = ml.data();
  float* l = ml.data() + mrows;
  for (int64_t i = 0; i < mrows; ++i) {
    const T* q = static_cast<const T*>(p.q.at(r.b, it.h * g + i % g, r.q_lo + it.i0 + i / g));
    for (int64_t t = 0; t < d; ++t) qbuf[i * d + t] = load_f(q, t) * c;
    m[i] = kNegInf;
  }
  const int64_t qa = r.q_pos + it.i0, qb = qa + it.npos - 1;
  each_key_block<T>(p, r, it.h, qa, qb, krow.data(), vrow.data(), [&](int64_t ka, int64_t nk) {
    for (int64_t i = 0; i < mrows; ++i) {
      const int64_t qpos = qa + i / g;
      float mx = kNegInf;
      for (int64_t j = 0; j < nk; ++j) {
        float s = kNegInf;
        if (visible(p, ka + j, qpos)) {
          float acc = 0.f;
          for (int64_t t = 0; t < d; ++t) acc += qbuf[i * d + t] * load_f(krow[j], t);
          s = acc;
        }
        sbuf[j] = s;
        mx = std::max(mx, s);
      }
      const float mnew = std::max(m[i], mx);
      if (mnew == kNegInf) continue;
      const float alpha = std::exp2(m[i] - mnew);
      float* o = obuf.data() + i * d;
      for (int64_t t = 0; t < d; ++t) o[t] *= alpha;
      float sum = 0.f;
      for (int64_t j = 0; j < nk; ++j) {
        const float e = std::exp2(sbuf[j] - mnew);
        if (e == 0.f) continue;
        sum += e;
        for (int64_t t = 0; t < d; ++t) o[t] += e * load_f(vrow[j], t);
      }
      l[i] = l[i] * alpha + sum;
      m[i] = mnew;
    }
  });
  write_result(p, it, obuf.data(), d, m, l);
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <typename T>
__attribute__((flatten)) static void portable_item_avx2(const Problem& p, const Item& it) {
  portable_item<T>(p, it);
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------------
// AVX2 with FMA: the wide path's layout (S^T, the queries as lanes) in 8-lane vectors, any head size a multiple of 8.
// Every size of item takes it, a decode row's grouped heads too (up to 8 of them fill one vector). bfloat16 blocks
// are widened to float32 once per block of keys, which every query of the item then reads: the products are
// float32's.

#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline __m256 exp2_256(__m256 x) {  // 2^x, about 2 ulp; 2^-inf = 0 (below -126.5 it is 0)
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // [-0.5, 0.5]
  __m256 y = _mm256_set1_ps(1.535336188319500e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.339887440266574e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.618437357674640e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.550332471162809e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.402264791363012e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.931472028550421e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.f));
  // 2^n for n in [-127, 127]: n = -127 gives the bits of 0.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// S^T[j][i] = sum_t K[j][t] Qt[t][i] for R keys and MV vectors of 8 query lanes.
template <int R, int MV>
static inline void qk_avx2(const float* const* krow, const float* qt, int64_t ldq, int64_t d, float* s, int64_t lds) {
  __m256 acc[R][MV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t t = 0; t < d; ++t) {
    __m256 qv[MV];
    for (int v = 0; v < MV; ++v) qv[v] = _mm256_loadu_ps(qt + t * ldq + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 kb = _mm256_broadcast_ss(krow[r] + t);
      for (int v = 0; v < MV; ++v) acc[r][v] = _mm256_fmadd_ps(kb, qv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) _mm256_storeu_ps(s + r * lds + 8 * v, acc[r][v]);
}

// O[i][c] += sum_j P^T[j][i] V[j][c] for R query rows, NC vectors of 8 columns from column c0.
template <int R, int NC>
static inline void pv_avx2(const float* pt, int64_t ldp, const float* const* vrow, int64_t nk, float* o, int64_t ldo,
                           int64_t c0) {
  __m256 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NC; ++n) acc[r][n] = _mm256_loadu_ps(o + r * ldo + c0 + 8 * n);
  for (int64_t j = 0; j < nk; ++j) {
    __m256 vv[NC];
    for (int n = 0; n < NC; ++n) vv[n] = _mm256_loadu_ps(vrow[j] + c0 + 8 * n);
    for (int r = 0; r < R; ++r) {
      const __m256 pb = _mm256_broadcast_ss(pt + j * ldp + r);
      for (int n = 0; n < NC; ++n) acc[r][n] = _mm256_fmadd_ps(pb, vv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NC; ++n) _mm256_storeu_ps(o + r * ldo + c0 + 8 * n, acc[r][n]);
}

static inline void widen_bf16_rows(const bf16* const* src, int64_t nk, int64_t d, float* dst, const float** rows) {
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t t = 0; t < d; t += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[j] + t));
      _mm256_storeu_ps(dst + j * d + t, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    rows[j] = dst + j * d;
  }
}

template <typename T>
static void avx2_item(const Problem& p, const Item& it) {
  constexpr bool BF = std::is_same_v<T, bf16>;
  const Row& r = p.rows[it.row];
  const int64_t g = p.group, d = p.d, mrows = it.npos * g;
  const int64_t MP = (mrows + 15) / 16 * 16;  // query lanes, in pairs of vectors
  const float c = p.scale * kLog2e;
  thread_local std::vector<float> qt, sbuf, obuf, kwide, vwide, mlq;
  thread_local std::vector<const T*> krow, vrow;
  thread_local std::vector<const float*> kf, vf;
  qt.assign(d * MP, 0.f);
  sbuf.resize(kBlockKeys * MP);
  obuf.assign(MP * d, 0.f);
  mlq.resize(4 * MP);
  krow.resize(kBlockKeys + 1);
  vrow.resize(kBlockKeys + 1);
  kf.resize(kBlockKeys);
  vf.resize(kBlockKeys);
  if constexpr (BF) {
    kwide.resize(kBlockKeys * d);
    vwide.resize(kBlockKeys * d);
  }
  for (int64_t i = 0; i < mrows; ++i) {  // Qt[t][i], pre-scaled into log2 units; lanes past mrows stay zero
    const T* q = static_cast<const T*>(p.q.at(r.b, it.h * g + i % g, r.q_lo + it.i0 + i / g));
    for (int64_t t = 0; t < d; ++t) qt[t * MP + i] = load_f(q, t) * c;
  }
  float* m = mlq.data();
  float* l = m + MP;
  float* qpos_f = m + 2 * MP;
  float* alpha = m + 3 * MP;
  for (int64_t i = 0; i < MP; ++i) {
    qpos_f[i] = static_cast<float>(i < mrows ? i / g : 0);  // relative to qa: exact in float32 below 2^24
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  const int64_t qa = r.q_pos + it.i0, qb = qa + it.npos - 1;
  const __m256 neg = _mm256_set1_ps(kNegInf);
  each_key_block<T>(p, r, it.h, qa, qb, krow.data(), vrow.data(), [&](int64_t ka, int64_t nk) {
    const float* const* K;
    const float* const* V;
    if constexpr (BF) {
      widen_bf16_rows(krow.data(), nk, d, kwide.data(), kf.data());
      widen_bf16_rows(vrow.data(), nk, d, vwide.data(), vf.data());
      K = kf.data();
      V = vf.data();
    } else {
      K = krow.data();
      V = vrow.data();
    }
    float* s = sbuf.data();
    for (int64_t i0 = 0; i0 < MP; i0 += 16) {
      int64_t j = 0;
      for (; j + 4 <= nk; j += 4) qk_avx2<4, 2>(K + j, qt.data() + i0, MP, d, s + j * MP + i0, MP);
      for (; j < nk; ++j) qk_avx2<1, 2>(K + j, qt.data() + i0, MP, d, s + j * MP + i0, MP);
    }
    const bool full = all_visible(p, ka, ka + nk - 1, qa, qb);
    for (int64_t i0 = 0; i0 < MP; i0 += 8) {
      __m256 mx = neg;
      const __m256 qp = _mm256_loadu_ps(qpos_f + i0);
      for (int64_t j = 0; j < nk; ++j) {
        __m256 x = _mm256_loadu_ps(s + j * MP + i0);
        if (!full) {
          const __m256 kp = _mm256_set1_ps(static_cast<float>(ka + j - qa));
          __m256 hide = _mm256_setzero_ps();
          if (p.causal) hide = _mm256_or_ps(hide, _mm256_cmp_ps(kp, qp, _CMP_GT_OQ));
          if (p.window > 0)
            hide = _mm256_or_ps(hide, _mm256_cmp_ps(kp, _mm256_sub_ps(qp, _mm256_set1_ps(static_cast<float>(p.window))),
                                                    _CMP_LE_OQ));
          x = _mm256_blendv_ps(x, neg, hide);
          _mm256_storeu_ps(s + j * MP + i0, x);
        }
        mx = _mm256_max_ps(mx, x);
      }
      const __m256 mold = _mm256_loadu_ps(m + i0);
      const __m256 mnew = _mm256_max_ps(mold, mx);
      const __m256 base = _mm256_blendv_ps(mnew, _mm256_setzero_ps(), _mm256_cmp_ps(mnew, neg, _CMP_EQ_OQ));
      const __m256 a = exp2_256(_mm256_sub_ps(mold, base));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < nk; ++j) {
        const __m256 e = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(s + j * MP + i0), base));
        _mm256_storeu_ps(s + j * MP + i0, e);  // S^T becomes P^T in place
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_storeu_ps(alpha + i0, a);
      _mm256_storeu_ps(m + i0, mnew);
      _mm256_storeu_ps(l + i0, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(l + i0), a), sum));
    }
    for (int64_t i = 0; i < mrows; ++i) {
      if (alpha[i] != 1.f) {
        const __m256 a = _mm256_set1_ps(alpha[i]);
        for (int64_t t = 0; t < d; t += 8)
          _mm256_storeu_ps(obuf.data() + i * d + t, _mm256_mul_ps(a, _mm256_loadu_ps(obuf.data() + i * d + t)));
      }
    }
    // O += P V, 16 columns and 6 rows (12 accumulators) at a time; a last 8 columns 12 rows at a time.
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      int64_t i = 0;
      if (d - c0 >= 16) {
        for (; i + 6 <= mrows; i += 6) pv_avx2<6, 2>(s + i, MP, V, nk, obuf.data() + i * d, d, c0);
        for (; i < mrows; ++i) pv_avx2<1, 2>(s + i, MP, V, nk, obuf.data() + i * d, d, c0);
      } else {
        for (; i + 12 <= mrows; i += 12) pv_avx2<12, 1>(s + i, MP, V, nk, obuf.data() + i * d, d, c0);
        for (; i < mrows; ++i) pv_avx2<1, 1>(s + i, MP, V, nk, obuf.data() + i * d, d, c0);
      }
    }
  });
  write_result(p, it, obuf.data(), d, m, l);
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------------
// AVX-512: float32 with FMA, bfloat16 with vdpbf16ps. Head sizes that are a multiple of 16.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

static inline __m512 exp2_512(__m512 x) {  // 2^x, about 2 ulp; 2^-inf = 0
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 y = _mm512_set1_ps(1.535336188319500e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.339887440266574e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.618437357674640e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550332471162809e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402264791363012e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931472028550421e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// S^T[j][i] = sum_t K[j][t] Qt[t][i] over R keys at a time, MV vectors of 16 query lanes.
template <int R, int MV>
static inline void qk_f32(const float* const* krow, const float* qt, int64_t ldq, int64_t d, float* s,
                          int64_t lds) {
  __m512 acc[R][MV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < d; ++t) {
    __m512 qv[MV];
    for (int v = 0; v < MV; ++v) qv[v] = _mm512_loadu_ps(qt + t * ldq + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 kb = _mm512_set1_ps(krow[r][t]);
      for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_fmadd_ps(kb, qv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(s + r * lds + 16 * v, acc[r][v]);
}

// The same in bfloat16 pairs: Qt holds [t/2][i][2], a key row's pair t is one 32-bit word.
template <int R, int MV>
static inline void qk_bf16(const bf16* const* krow, const bf16* qt, int64_t ldq, int64_t d, float* s,
                           int64_t lds) {
  __m512 acc[R][MV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < d / 2; ++t) {
    __m512bh qv[MV];
    for (int v = 0; v < MV; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qt + (t * ldq + 16 * v) * 2);
    for (int r = 0; r < R; ++r) {
      int32_t w;
      std::memcpy(&w, krow[r] + 2 * t, 4);
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(w);
      for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], kb, qv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(s + r * lds + 16 * v, acc[r][v]);
}

// O[i][c] += sum_j P(j, i) V[j][c] for R query vectors, NC vectors of 16 columns from column c0; P(j, i) is
// p[j * sj + i * si] (the wide path's P^T, sj = lanes, si = 1; the narrow path's P, sj = 1, si = keys).
template <int R, int NC>
static inline void pv_f32(const float* p, int64_t sj, int64_t si, const float* const* vrow, int64_t nk, float* o,
                          int64_t ldo, int64_t c0) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NC; ++n) acc[r][n] = _mm512_loadu_ps(o + r * ldo + c0 + 16 * n);
  for (int64_t j = 0; j < nk; ++j) {
    __m512 vv[NC];
    for (int n = 0; n < NC; ++n) vv[n] = _mm512_loadu_ps(vrow[j] + c0 + 16 * n);
    for (int r = 0; r < R; ++r) {
      const __m512 pb = _mm512_set1_ps(p[j * sj + r * si]);
      for (int n = 0; n < NC; ++n) acc[r][n] = _mm512_fmadd_ps(pb, vv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NC; ++n) _mm512_storeu_ps(o + r * ldo + c0 + 16 * n, acc[r][n]);
}

// bfloat16: V packed as [j/2][c][2] (ldv columns), nk2 key pairs; the probabilities of keys (2u, 2u + 1) for query
// i are the 32-bit word p[u * su + i * si] (the wide path's [j/2][i][2], the narrow path's rows of keys).
template <int R, int NC>
static inline void pv_bf16(const uint32_t* p, int64_t su, int64_t si, const bf16* vp, int64_t ldv, int64_t nk2,
                           float* o, int64_t ldo, int64_t c0) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NC; ++n) acc[r][n] = _mm512_loadu_ps(o + r * ldo + c0 + 16 * n);
  for (int64_t u = 0; u < nk2; ++u) {
    __m512bh vv[NC];
    for (int n = 0; n < NC; ++n) vv[n] = (__m512bh)_mm512_loadu_si512(vp + (u * ldv + c0 + 16 * n) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[u * su + r * si]));
      for (int n = 0; n < NC; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], pb, vv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NC; ++n) _mm512_storeu_ps(o + r * ldo + c0 + 16 * n, acc[r][n]);
}

template <typename KT, int MV>
static void qk_block(const KT* const* krow, int64_t nk, const KT* qt, int64_t ldq, int64_t d,
                     float* s, int64_t lds) {
  constexpr int R = MV <= 2 ? 8 : 4;
  int64_t j = 0;
  for (; j + R <= nk; j += R) {
    if constexpr (std::is_same_v<KT, float>) {
      qk_f32<R, MV>(krow + j, qt, ldq, d, s + j * lds, lds);
    } else {
      qk_bf16<R, MV>(krow + j, qt, ldq, d, s + j * lds, lds);
    }
  }
  for (; j < nk; ++j) {
    if constexpr (std::is_same_v<KT, float>) {
      qk_f32<1, MV>(krow + j, qt, ldq, d, s + j * lds, lds);
    } else {
      qk_bf16<1, MV>(krow + j, qt, ldq, d, s + j * lds, lds);
    }
  }
}

template <int NC>
static void pv_rows_f32(const float* pt, int64_t ldp, const float* const* vrow, int64_t nk, float* o, int64_t ldo,
                        int64_t mrows, int64_t c0) {
  constexpr int R = NC >= 4 ? 6 : (NC == 3 ? 8 : 12);
  int64_t i = 0;
  for (; i + R <= mrows; i += R) pv_f32<R, NC>(pt + i, ldp, 1, vrow, nk, o + i * ldo, ldo, c0);
  for (; i < mrows; ++i) pv_f32<1, NC>(pt + i, ldp, 1, vrow, nk, o + i * ldo, ldo, c0);
}

template <int NC>
static void pv_rows_bf16(const bf16* pt, int64_t ldp, const bf16* vp, int64_t ldv, int64_t nk2, float* o,
                         int64_t ldo, int64_t mrows, int64_t c0) {
  constexpr int R = NC >= 4 ? 6 : (NC == 3 ? 8 : 12);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(pt);
  int64_t i = 0;
  for (; i + R <= mrows; i += R) pv_bf16<R, NC>(words + i, ldp, 1, vp, ldv, nk2, o + i * ldo, ldo, c0);
  for (; i < mrows; ++i) pv_bf16<1, NC>(words + i, ldp, 1, vp, ldv, nk2, o + i * ldo, ldo, c0);
}

// The indices that interleave two vectors' 16-bit lanes 0-15, (a[q], b[q]) at word q (add 16 for lanes 16-31).
static inline __m512i interleave_low() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                          35, 3, 34, 2, 33, 1, 32, 0);
}

// V rows of a block interleaved in pairs, [j/2][c][2] (a missing odd row reads as zero).
static void pack_values_pairs(const bf16* const* vrow, int64_t nk, int64_t d, bf16* vpack) {
  const __m512i lo_idx = interleave_low();
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t u = 0; u < (nk + 1) / 2; ++u) {
    const bool odd = 2 * u + 1 < nk;
    for (int64_t t = 0; t < d; t += 32) {
      const int64_t w = std::min<int64_t>(32, d - t);
      const __mmask32 mk = w == 32 ? 0xffffffffu : ((1u << w) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(mk, vrow[2 * u] + t);
      const __m512i b = odd ? _mm512_maskz_loadu_epi16(mk, vrow[2 * u + 1] + t) : _mm512_setzero_si512();
      bf16* dst = vpack + (u * d + t) * 2;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_idx, b));
      if (w > 16) _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// f(std::integral_constant<int, NC>, c0) for the head's columns in chunks of up to 64 (NC vectors of 16).
template <typename F>
static inline void by_column_chunks(int64_t d, F&& f) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    switch (std::min<int64_t>(4, (d - c0) / 16)) {
      case 4: f(std::integral_constant<int, 4>{}, c0); break;
      case 3: f(std::integral_constant<int, 3>{}, c0); break;
      case 2: f(std::integral_constant<int, 2>{}, c0); break;
      default: f(std::integral_constant<int, 1>{}, c0);
    }
  }
}

template <typename T, int MV>
static void avx512_item(const Problem& p, const Item& it) {
  constexpr bool BF = std::is_same_v<T, bf16>;
  constexpr int64_t MP = 16 * MV;  // query lanes
  const Row& r = p.rows[it.row];
  const int64_t g = p.group, d = p.d, mrows = it.npos * g;
  const float c = p.scale * kLog2e;
  thread_local std::vector<float> qt32, sbuf, obuf;
  thread_local std::vector<bf16> qt16, pt16, vpack;
  thread_local std::vector<float> ptf;
  thread_local std::vector<const T*> krow, vrow;
  sbuf.resize(kBlockKeys * MP);
  obuf.assign(MP * d, 0.f);
  krow.resize(kBlockKeys + 1);
  vrow.resize(kBlockKeys + 1);
  // The queries, transposed: float32 Qt[t][i]; bfloat16 Qt[t/2][i][2]. Lanes past mrows stay zero.
  if constexpr (BF) {
    qt16.assign(d * MP, 0);
    pt16.resize(kBlockKeys * MP);
    vpack.resize(kBlockKeys * d);
    for (int64_t i = 0; i < mrows; ++i) {
      const bf16* q = static_cast<const bf16*>(p.q.at(r.b, it.h * g + i % g, r.q_lo + it.i0 + i / g));
      for (int64_t t = 0; t < d; ++t) qt16[((t >> 1) * MP + i) * 2 + (t & 1)] = q[t];
    }
  } else {
    qt32.assign(d * MP, 0.f);
    ptf.resize(kBlockKeys * MP);
    for (int64_t i = 0; i < mrows; ++i) {
      const float* q = static_cast<const float*>(p.q.at(r.b, it.h * g + i % g, r.q_lo + it.i0 + i / g));
      for (int64_t t = 0; t < d; ++t) qt32[t * MP + i] = q[t];
    }
  }
  // Per lane: its position, the running maximum (log2 units) and sum.
  alignas(64) float qpos_f[MP], m[MP], l[MP];
  const int64_t qa = r.q_pos + it.i0, qb = qa + it.npos - 1;
  for (int64_t i = 0; i < MP; ++i) {
    qpos_f[i] = static_cast<float>(i < mrows ? i / g : 0);  // relative to qa: exact in float32 below 2^24
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  const __m512 cv = _mm512_set1_ps(c);
  const __m512 neg = _mm512_set1_ps(kNegInf);
  each_key_block<T>(p, r, it.h, qa, qb, krow.data(), vrow.data(), [&](int64_t ka, int64_t nk) {
      float* s = sbuf.data();
      if constexpr (BF) {
        qk_block<bf16, MV>(krow.data(), nk, qt16.data(), MP, d, s, MP);
      } else {
        qk_block<float, MV>(krow.data(), nk, qt32.data(), MP, d, s, MP);
      }
      const bool full = all_visible(p, ka, ka + nk - 1, qa, qb);
      // Scale into log2 units, mask by position, and take the column maxima.
      __m512 mx[MV];
      for (int v = 0; v < MV; ++v) mx[v] = neg;
      for (int64_t j = 0; j < nk; ++j) {
        const float rel = static_cast<float>(ka + j - qa);  // key position relative to qa
        for (int v = 0; v < MV; ++v) {
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j * MP + 16 * v), cv);
          if (!full) {
            const __m512 qp = _mm512_loadu_ps(qpos_f + 16 * v);
            const __m512 kp = _mm512_set1_ps(rel);
            __mmask16 hide = 0;
            if (p.causal) hide |= _mm512_cmp_ps_mask(kp, qp, _CMP_GT_OQ);
            if (p.window > 0)
              hide |= _mm512_cmp_ps_mask(kp, _mm512_sub_ps(qp, _mm512_set1_ps(static_cast<float>(p.window))),
                                         _CMP_LE_OQ);
            x = _mm512_mask_mov_ps(x, hide, neg);
          }
          _mm512_storeu_ps(s + j * MP + 16 * v, x);
          mx[v] = _mm512_max_ps(mx[v], x);
        }
      }
      // Online softmax: new maxima, the old sums and outputs rescaled, the block's probabilities.
      alignas(64) float alpha[MP];
      __m512 base[MV];
      for (int v = 0; v < MV; ++v) {
        const __m512 mold = _mm512_loadu_ps(m + 16 * v);
        const __m512 mnew = _mm512_max_ps(mold, mx[v]);
        const __mmask16 none = _mm512_cmp_ps_mask(mnew, neg, _CMP_EQ_OQ);
        base[v] = _mm512_mask_mov_ps(mnew, none, _mm512_setzero_ps());  // a lane that sees nothing yet: 2^-inf = 0
        const __m512 a = exp2_512(_mm512_sub_ps(mold, base[v]));
        _mm512_storeu_ps(alpha + 16 * v, a);
        _mm512_storeu_ps(m + 16 * v, mnew);
        _mm512_storeu_ps(l + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(l + 16 * v), a));
      }
      __m512 sum[MV];
      for (int v = 0; v < MV; ++v) sum[v] = _mm512_setzero_ps();
      const int64_t nk_even = (nk + 1) & ~int64_t(1);
      const __m512i lo_idx = interleave_low();
      for (int64_t j = 0; j < nk_even; j += 2) {
        for (int v = 0; v < MV; ++v) {
          const __m512 e0 = exp2_512(_mm512_sub_ps(_mm512_loadu_ps(s + j * MP + 16 * v), base[v]));
          const __m512 e1 = j + 1 < nk ? exp2_512(_mm512_sub_ps(_mm512_loadu_ps(s + (j + 1) * MP + 16 * v), base[v]))
                                       : _mm512_setzero_ps();
          sum[v] = _mm512_add_ps(sum[v], _mm512_add_ps(e0, e1));  // float32 probabilities: the log-sum-exp exact
          if constexpr (BF) {
            // Rounded to bfloat16 for P.V, as a bfloat16 GEMM takes them; P^T as [j/2][i][2].
            const __m512i a = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(e0));
            const __m512i b = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(e1));
            _mm512_storeu_si512(pt16.data() + ((j >> 1) * MP + 16 * v) * 2, _mm512_permutex2var_epi16(a, lo_idx, b));
          } else {
            _mm512_storeu_ps(ptf.data() + j * MP + 16 * v, e0);
            _mm512_storeu_ps(ptf.data() + (j + 1) * MP + 16 * v, e1);
          }
        }
      }
      for (int v = 0; v < MV; ++v) _mm512_storeu_ps(l + 16 * v, _mm512_add_ps(_mm512_loadu_ps(l + 16 * v), sum[v]));
      for (int64_t i = 0; i < mrows; ++i) {
        if (alpha[i] != 1.f) {
          const __m512 a = _mm512_set1_ps(alpha[i]);
          for (int64_t t = 0; t < d; t += 16)
            _mm512_storeu_ps(obuf.data() + i * d + t, _mm512_mul_ps(a, _mm512_loadu_ps(obuf.data() + i * d + t)));
        }
      }
      // O += P V, 64 columns at a time.
      if constexpr (BF) {
        pack_values_pairs(vrow.data(), nk, d, vpack.data());
        by_column_chunks(d, [&](auto nc, int64_t c0) {
          pv_rows_bf16<decltype(nc)::value>(pt16.data(), MP, vpack.data(), d, nk_even / 2, obuf.data(), d, mrows, c0);
        });
      } else {
        by_column_chunks(d, [&](auto nc, int64_t c0) {
          pv_rows_f32<decltype(nc)::value>(ptf.data(), MP, vrow.data(), nk, obuf.data(), d, mrows, c0);
        });
      }
  });
  // m is in log2 units: write_result takes m * ln2 + ln(l).
  write_result(p, it, obuf.data(), d, m, l);
}

// ---- The narrow path: at most kNarrow query vectors (a decode row's grouped heads). The wide path's S^T would use
// M of 16 lanes; here keys are the lanes instead: each block of 64 keys is transposed (16x16 tiles of 32-bit words)
// so a query's scores for 16 keys are one vector, and the V rows are loaded once for all M queries.

constexpr int kNarrow = 6;  // avx512_dispatch instantiates narrow_item for 1..kNarrow

static inline void transpose16(__m512i* r) {  // 16 rows of 16 words -> 16 columns, in order
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Kt[w][j] = word w of key row j, for the block's nk keys (rows past nk are zero); words per row W.
static void pack_keys_transposed(const void* const* krow, int64_t nk, int64_t words, uint32_t* kt) {
  for (int64_t j0 = 0; j0 < kBlockKeys; j0 += 16) {
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      const int64_t w = std::min<int64_t>(16, words - w0);
      const __mmask16 mk = w == 16 ? 0xffff : static_cast<__mmask16>((1u << w) - 1);
      __m512i r[16];
      for (int k = 0; k < 16; ++k)
        r[k] = j0 + k < nk ? _mm512_maskz_loadu_epi32(mk, static_cast<const uint32_t*>(krow[j0 + k]) + w0)
                           : _mm512_setzero_si512();
      transpose16(r);
      for (int k = 0; k < w; ++k) _mm512_storeu_si512(kt + (w0 + k) * kBlockKeys + j0, r[k]);
    }
  }
}

template <typename T, int M>
static inline void qk_narrow(const T* q, int64_t d, const uint32_t* kt, int64_t words, __m512 acc[M][4]) {
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t w = 0; w < words; ++w) {
    __m512i kv[4];
    for (int v = 0; v < 4; ++v) kv[v] = _mm512_loadu_si512(kt + w * kBlockKeys + 16 * v);
    for (int i = 0; i < M; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        const __m512 qb = _mm512_set1_ps(q[i * d + w]);
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(qb, _mm512_castsi512_ps(kv[v]), acc[i][v]);
      } else {
        int32_t word;
        std::memcpy(&word, q + i * d + 2 * w, 4);
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(word);
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], qb, (__m512bh)kv[v]);
      }
    }
  }
}

template <typename T, int M>
static void narrow_item(const Problem& p, const Item& it) {
  constexpr bool BF = std::is_same_v<T, bf16>;
  const Row& r = p.rows[it.row];
  const int64_t g = p.group, d = p.d, words = BF ? d / 2 : d;
  const float c = p.scale * kLog2e;
  thread_local std::vector<T> qbuf;
  thread_local std::vector<uint32_t> kt;
  thread_local std::vector<float> obuf, pf;
  thread_local std::vector<bf16> pb16, vpack;
  thread_local std::vector<const T*> krow, vrow;
  qbuf.resize(M * d);
  kt.resize(words * kBlockKeys);
  obuf.assign(M * d, 0.f);
  krow.resize(kBlockKeys);
  vrow.resize(kBlockKeys);
  if constexpr (BF) {
    pb16.resize(M * kBlockKeys);
    vpack.resize(kBlockKeys * d);
  } else {
    pf.resize(M * kBlockKeys);
  }
  for (int i = 0; i < M; ++i)
    std::memcpy(qbuf.data() + i * d, p.q.at(r.b, it.h * g + i % g, r.q_lo + it.i0 + i / g), d * sizeof(T));
  float m[M], l[M];
  for (int i = 0; i < M; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  const int64_t qa = r.q_pos + it.i0, qb = qa + it.npos - 1;
  const __m512 cv = _mm512_set1_ps(c);
  const __m512 neg = _mm512_set1_ps(kNegInf);
  const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  each_key_block<T>(p, r, it.h, qa, qb, krow.data(), vrow.data(), [&](int64_t ka, int64_t nk) {
      pack_keys_transposed(reinterpret_cast<const void* const*>(krow.data()), nk, words, kt.data());
      __m512 acc[M][4];
      qk_narrow<T, M>(qbuf.data(), d, kt.data(), words, acc);
      const bool full = all_visible(p, ka, ka + nk - 1, qa, qb) && nk == kBlockKeys;
      for (int i = 0; i < M; ++i) {
        __m512 x[4];
        const float qrel = static_cast<float>(i / g);
        __m512 mx = neg;
        for (int v = 0; v < 4; ++v) {
          x[v] = _mm512_mul_ps(acc[i][v], cv);
          if (!full) {
            const __m512 rel = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(ka - qa + 16 * v)));
            __mmask16 hide = _mm512_cmp_ps_mask(_mm512_add_ps(lane, _mm512_set1_ps(16.f * v)),
                                                _mm512_set1_ps(static_cast<float>(nk)), _CMP_GE_OQ);
            if (p.causal) hide |= _mm512_cmp_ps_mask(rel, _mm512_set1_ps(qrel), _CMP_GT_OQ);
            if (p.window > 0)
              hide |= _mm512_cmp_ps_mask(rel, _mm512_set1_ps(qrel - static_cast<float>(p.window)), _CMP_LE_OQ);
            x[v] = _mm512_mask_mov_ps(x[v], hide, neg);
          }
          mx = _mm512_max_ps(mx, x[v]);
        }
        const float mnew = std::max(m[i], _mm512_reduce_max_ps(mx));
        const float base = mnew == kNegInf ? 0.f : mnew;
        const float alpha = m[i] == kNegInf ? 0.f : std::exp2(m[i] - base);
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < 4; ++v) {
          const __m512 e = exp2_512(_mm512_sub_ps(x[v], _mm512_set1_ps(base)));
          sum = _mm512_add_ps(sum, e);
          if constexpr (BF) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb16.data() + i * kBlockKeys + 16 * v),
                                (__m256i)_mm512_cvtneps_pbh(e));
          } else {
            _mm512_storeu_ps(pf.data() + i * kBlockKeys + 16 * v, e);
          }
        }
        l[i] = l[i] * alpha + _mm512_reduce_add_ps(sum);
        m[i] = mnew;
        if (alpha != 1.f) {
          const __m512 a = _mm512_set1_ps(alpha);
          float* o = obuf.data() + i * d;
          for (int64_t t = 0; t < d; t += 16) _mm512_storeu_ps(o + t, _mm512_mul_ps(a, _mm512_loadu_ps(o + t)));
        }
      }
      if constexpr (BF) {
        pack_values_pairs(vrow.data(), nk, d, vpack.data());
        by_column_chunks(d, [&](auto nc, int64_t c0) {
          pv_bf16<M, decltype(nc)::value>(reinterpret_cast<const uint32_t*>(pb16.data()), 1, kBlockKeys / 2,
                                           vpack.data(), d, (nk + 1) / 2, obuf.data(), d, c0);
        });
      } else {
        by_column_chunks(d, [&](auto nc, int64_t c0) {
          pv_f32<M, decltype(nc)::value>(pf.data(), 1, kBlockKeys, vrow.data(), nk, obuf.data(), d, c0);
        });
      }
  });
  write_result(p, it, obuf.data(), d, m, l);
}

template <typename T>
static void avx512_dispatch(const Problem& p, const Item& it) {
  static_assert(kNarrow == 6, "the cases below are the narrow path's query counts");
  switch (it.npos * p.group) {  // a decode row's heads: the narrow path
    case 1: return narrow_item<T, 1>(p, it);
    case 2: return narrow_item<T, 2>(p, it);
    case 3: return narrow_item<T, 3>(p, it);
    case 4: return narrow_item<T, 4>(p, it);
    case 5: return narrow_item<T, 5>(p, it);
    case 6: return narrow_item<T, 6>(p, it);
    default: break;
  }
  const int64_t mv = (it.npos * p.group + 15) / 16;
  switch (mv) {
    case 1: avx512_item<T, 1>(p, it); break;
    case 2: avx512_item<T, 2>(p, it); break;
    case 3: avx512_item<T, 3>(p, it); break;
    case 4: avx512_item<T, 4>(p, it); break;
    case 5: avx512_item<T, 5>(p, it); break;
    default: avx512_item<T, 6>(p, it);
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------------
// The tile path, for rows of at least kTileMinPositions query positions (prefill): Q.K^T and P.V are ATen's
// batch-reduce GEMM (at::native::cpublas::brgemm, oneDNN's micro-kernels): AMX tiles where the CPU has them, its
// AVX-512 or AVX2 kernels elsewhere. The keys and values a call reads are packed once per call, in blocks of
// kBlockKeys aligned to their piece (K^T and V; bfloat16 in VNNI pairs where the CPU packs), and every work item
// of that K,V head reads the packed blocks. A work item is up to kTileRows query vectors; its block of scores is a
// plain [query][key] row each, masked by position as a range of keys.

constexpr int kTileRows = 256;         // query vectors per work item on the tile path
constexpr int kTileMinPositions = 16;  // a row with fewer query positions runs the vector path

struct Packed {  // one K,V head's keys and values as the tile path reads them, in blocks of kBlockKeys per piece
  bool vnni = false;
  int64_t h = -1;  // the K,V head packed
  std::vector<int64_t> first;  // per piece: the index of its first block, or -1 when no tile row reads it
  std::vector<int64_t> blocks;  // per piece: its number of blocks
  at::Tensor k, v;  // [count, kBlockKeys * d] of the input dtype, zero past a piece's last key
  int64_t block_elems = 0;
  const void* kblock(int64_t pi, int64_t bi) const {
    return static_cast<const char*>(k.data_ptr()) + (first[pi] + bi) * block_elems * k.element_size();
  }
  const void* vblock(int64_t pi, int64_t bi) const {
    return static_cast<const char*>(v.data_ptr()) + (first[pi] + bi) * block_elems * v.element_size();
  }
};

// K^T [t][j] (or [t/2][j][2] in pairs) and V [j][c] (or [j/2][c][2]) of one block of nk keys.
template <typename T>
static void pack_block(const Strided& K, const Strided& V, int64_t b, int64_t h, int64_t j0, int64_t nk, int64_t d,
                       bool vnni, T* kt, T* vb) {
  constexpr int64_t N = kBlockKeys;
  std::memset(kt, 0, sizeof(T) * N * d);
  std::memset(vb, 0, sizeof(T) * N * d);
  for (int64_t j = 0; j < nk; ++j) {
    const T* kr = static_cast<const T*>(K.at(b, h, j0 + j));
    const T* vr = static_cast<const T*>(V.at(b, h, j0 + j));
    if (vnni) {
      for (int64_t t = 0; t < d; ++t) kt[((t >> 1) * N + j) * 2 + (t & 1)] = kr[t];
      for (int64_t c = 0; c < d; ++c) vb[((j >> 1) * d + c) * 2 + (j & 1)] = vr[c];
    } else {
      for (int64_t t = 0; t < d; ++t) kt[t * N + j] = kr[t];
      std::memcpy(vb + j * d, vr, sizeof(T) * d);
    }
  }
}

// Head h's blocks of every piece a tile row reads, packed in parallel into pk (its buffers kept for the next head).
template <typename T>
static void pack_head(const Problem& p, const std::vector<bool>& tile_row, int64_t h, Packed& pk) {
  if (pk.first.empty()) {  // the first head: which pieces, how many blocks, the buffers
    pk.vnni = std::is_same_v<T, bf16> && at::native::cpublas::could_pack(at::kBFloat16);
    pk.first.assign(p.pieces.size(), -1);
    pk.blocks.assign(p.pieces.size(), 0);
    pk.block_elems = kBlockKeys * p.d;
    int64_t count = 0;
    for (size_t r = 0; r < p.rows.size(); ++r) {
      if (!tile_row[r]) continue;
      for (int64_t pi = p.rows[r].piece_lo; pi < p.rows[r].piece_hi; ++pi) {
        if (pk.first[pi] >= 0) continue;
        const Piece& pc = p.pieces[pi];
        pk.blocks[pi] = (pc.k_hi - pc.k_lo + kBlockKeys - 1) / kBlockKeys;
        pk.first[pi] = count;
        count += pk.blocks[pi];
      }
    }
    const auto dtype = std::is_same_v<T, bf16> ? at::kBFloat16 : at::kFloat;
    pk.k = at::empty({count, pk.block_elems}, at::TensorOptions().dtype(dtype));
    pk.v = at::empty({count, pk.block_elems}, at::TensorOptions().dtype(dtype));
  }
  pk.h = h;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (piece, block)
  for (size_t pi = 0; pi < p.pieces.size(); ++pi)
    for (int64_t bi = 0; pk.first[pi] >= 0 && bi < pk.blocks[pi]; ++bi) tasks.emplace_back(pi, bi);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const auto [pi, bi] = tasks[i];
      const Piece& pc = p.pieces[pi];
      const int64_t j0 = pc.k_lo + bi * kBlockKeys;
      pack_block<T>(p.k[pc.t], p.v[pc.t], pc.b, h, j0, std::min<int64_t>(kBlockKeys, pc.k_hi - j0), p.d, pk.vnni,
                    static_cast<T*>(const_cast<void*>(pk.kblock(pi, bi))),
                    static_cast<T*>(const_cast<void*>(pk.vblock(pi, bi))));
    }
  });
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// Eight float32 probabilities to bfloat16 (round to nearest even; they are finite).
static inline void store_bf16x8(bf16* dst, __m256 x) {
  __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

template <typename T>
static void tiles_item(const Problem& p, const Packed& pk, const Item& it) {
  using Elem = std::conditional_t<std::is_same_v<T, bf16>, at::BFloat16, float>;
  constexpr int64_t N = kBlockKeys;
  const Row& r = p.rows[it.row];
  const int64_t g = p.group, d = p.d, mrows = it.npos * g;
  const float c = p.scale * kLog2e;
  thread_local std::vector<T> qbuf, pbuf;
  thread_local std::vector<float> sbuf, obuf, ml;
  qbuf.resize(mrows * d);
  pbuf.resize(mrows * N);
  sbuf.resize(mrows * N);
  obuf.assign(mrows * d, 0.f);
  ml.resize(3 * mrows);
  float* m = ml.data();
  float* l = m + mrows;
  float* alpha = m + 2 * mrows;
  for (int64_t i = 0; i < mrows; ++i) {  // Q rows in the item's order: position-major, the group's heads within
    const T* q = static_cast<const T*>(p.q.at(r.b, it.h * g + i % g, r.q_lo + it.i0 + i / g));
    std::memcpy(qbuf.data() + i * d, q, sizeof(T) * d);
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  const int64_t qa = r.q_pos + it.i0, qb = qa + it.npos - 1;
  const __m256 neg = _mm256_set1_ps(kNegInf);
  const __m256 cv = _mm256_set1_ps(c);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t pi = r.piece_lo; pi < r.piece_hi; ++pi) {
    const Piece& pc = p.pieces[pi];
    int64_t lo, hi;
    visible_span(p, pc, qa, qb, &lo, &hi);
    if (lo >= hi) continue;
    for (int64_t bi = (lo - pc.k_lo) / N; pc.k_lo + bi * N < hi; ++bi) {
      const int64_t j0 = pc.k_lo + bi * N, nk = std::min<int64_t>(N, pc.k_hi - j0);
      const int64_t ka = pc.k_pos + (j0 - pc.k_lo);  // the block's first key position
      at::native::cpublas::brgemm(mrows, N, d, d, N, N, false, reinterpret_cast<const Elem*>(qbuf.data()),
                                  static_cast<const Elem*>(pk.kblock(pi, bi)), sbuf.data(), pk.vnni);
      for (int64_t i = 0; i < mrows; ++i) {
        const int64_t qpos = qa + i / g;
        // The keys this query sees are the range [jlo, jhi) of the block.
        int64_t jlo = 0, jhi = nk;
        if (p.causal) jhi = std::min<int64_t>(jhi, qpos - ka + 1);
        if (p.window > 0) jlo = std::max<int64_t>(0, qpos - p.window + 1 - ka);
        float* s = sbuf.data() + i * N;
        T* prow = pbuf.data() + i * N;
        const __m256i vlo = _mm256_set1_epi32(static_cast<int>(std::max<int64_t>(jlo, -1)));
        const __m256i vhi = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(jhi, -1, N)));
        __m256 mx = neg;
        for (int64_t j = 0; j < N; j += 8) {
          const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(j)));
          const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(vlo, idx), _mm256_cmpgt_epi32(vhi, idx));
          const __m256 x = _mm256_blendv_ps(neg, _mm256_mul_ps(_mm256_loadu_ps(s + j), cv), _mm256_castsi256_ps(in));
          _mm256_storeu_ps(s + j, x);
          mx = _mm256_max_ps(mx, x);
        }
        float mxs[8];
        _mm256_storeu_ps(mxs, mx);
        float rowmax = kNegInf;
        for (float x : mxs) rowmax = std::max(rowmax, x);
        const float mnew = std::max(m[i], rowmax);
        if (mnew == kNegInf) {  // nothing visible yet: the row's probabilities are 0
          std::memset(prow, 0, sizeof(T) * N);
          alpha[i] = 1.f;
          continue;
        }
        const __m256 base = _mm256_set1_ps(mnew);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < N; j += 8) {
          const __m256 e = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(s + j), base));
          sum = _mm256_add_ps(sum, e);
          if constexpr (std::is_same_v<T, bf16>) {
            store_bf16x8(prow + j, e);
          } else {
            _mm256_storeu_ps(prow + j, e);
          }
        }
        float sums[8];
        _mm256_storeu_ps(sums, sum);
        float total = 0.f;
        for (float x : sums) total += x;
        alpha[i] = std::exp2(m[i] - mnew);
        l[i] = l[i] * alpha[i] + total;
        m[i] = mnew;
      }
      for (int64_t i = 0; i < mrows; ++i) {
        if (alpha[i] == 1.f) continue;
        const __m256 a = _mm256_set1_ps(alpha[i]);
        float* o = obuf.data() + i * d;
        for (int64_t t = 0; t < d; t += 8) _mm256_storeu_ps(o + t, _mm256_mul_ps(a, _mm256_loadu_ps(o + t)));
      }
      at::native::cpublas::brgemm(mrows, d, N, N, d, d, true, reinterpret_cast<const Elem*>(pbuf.data()),
                                  static_cast<const Elem*>(pk.vblock(pi, bi)), obuf.data(), pk.vnni);
    }
  }
  write_result(p, it, obuf.data(), d, m, l);
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------------

enum class Isa { portable, avx2, avx512, avx512bf16 };

static Isa host_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512bf16") ? Isa::avx512bf16 : Isa::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
  return Isa::portable;
}

static const char* isa_name(Isa i) {
  switch (i) {
    case Isa::avx512bf16: return "avx512bf16";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

static Isa chosen_isa() {  // the host's, or a lower one named by KVR_ATTENTION_ISA
  const Isa host = host_isa();
  const char* want = std::getenv("KVR_ATTENTION_ISA");
  if (!want || !*want) return host;
  for (Isa i : {Isa::portable, Isa::avx2, Isa::avx512, Isa::avx512bf16}) {
    if (std::string(want) == isa_name(i)) {
      TORCH_CHECK(static_cast<int>(i) <= static_cast<int>(host), "KVR_ATTENTION_ISA=", want,
                  " is beyond this CPU (", isa_name(host), ")");
      return i;
    }
  }
  TORCH_CHECK(false, "KVR_ATTENTION_ISA=", want, " is none of portable, avx2, avx512, avx512bf16");
  return host;
}

using ItemFn = void (*)(const Problem&, const Item&);

static ItemFn pick(const Problem& p, Isa isa) {
  // The vector paths hold at most kTargetRows query vectors (a block of one position carries the whole group).
  const bool fits = p.d % 16 == 0 && p.group <= kTargetRows;
  const bool fits_avx2 = p.d % 8 == 0 && p.group <= kTargetRows;
  if (p.bf16_in) {
    if (isa == Isa::avx512bf16 && fits) return avx512_dispatch<bf16>;
    if (isa >= Isa::avx2 && fits_avx2) return avx2_item<bf16>;
    return isa >= Isa::avx2 ? portable_item_avx2<bf16> : portable_item<bf16>;
  }
  if (isa >= Isa::avx512 && fits) return avx512_dispatch<float>;
  if (isa >= Isa::avx2 && fits_avx2) return avx2_item<float>;
  return isa >= Isa::avx2 ? portable_item_avx2<float> : portable_item<float>;
}

// The tile path: KVR_ATTENTION_TILES=1 or 0 forces it on or off for both dtypes, KVR_ATTENTION_TILES_FLOAT32 and
// KVR_ATTENTION_TILES_BFLOAT16 for one (what the Python side sets from the paths it timed: kernels.auto_choice).
// Without them float32 takes it (oneDNN's float32 micro-kernels run at the GEMM rate on AVX2), and bfloat16
// where the CPU has AMX tiles (cpublas::could_pack) or no bfloat16 vector path of ours (AVX2 hosts, which widen
// it). The tile path needs AVX2 and a head size that is a multiple of 8.
static int tiles_forced(const char* name) {  // 1 or 0 as the variable says, -1 where it is unset
  const char* want = std::getenv(name);
  if (!want || !*want) return -1;
  const std::string w(want);
  TORCH_CHECK(w == "0" || w == "1", name, "=", w, " is neither 0 nor 1");
  return w == "1";
}

static bool tiles_wanted(bool bf16_in) {
  int forced = tiles_forced("KVR_ATTENTION_TILES");
  if (forced < 0) forced = tiles_forced(bf16_in ? "KVR_ATTENTION_TILES_BFLOAT16" : "KVR_ATTENTION_TILES_FLOAT32");
  if (forced >= 0) return forced == 1;
  if (!bf16_in) return true;
  return at::native::cpublas::could_pack(at::kBFloat16) || chosen_isa() < Isa::avx512bf16;
}

static bool tiles_on(const Problem& p) {
  return chosen_isa() >= Isa::avx2 && p.d % 8 == 0 && tiles_wanted(p.bf16_in);
}

std::string isa() {
  return isa_name(chosen_isa());
}

// The path a prefill row (kTileMinPositions positions or more, head size a multiple of 8) takes in this dtype:
// "amx" (tiles), "brgemm" (oneDNN's AVX-512 or AVX2 micro-kernels), or the vector path's instruction set.
std::string path(bool bfloat16) {
  const Isa i = chosen_isa();
  if (i >= Isa::avx2 && tiles_wanted(bfloat16))
    return bfloat16 && at::native::cpublas::could_pack(at::kBFloat16) ? "amx" : "brgemm";
  return isa_name(i);
}

static Strided strided(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 4, what, " must be [batch, heads, tokens, head_dim], got ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1, what, "'s head_dim must be contiguous");
  return Strided{static_cast<const char*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2),
                 static_cast<int>(t.element_size())};
}

// The split rows' outputs: each part's (float32, normalised, with its log-sum-exp) weighted by exp(lse_s - lse),
// where lse is the parts' together; a part that saw no key weighs 0.
static void merge_parts(const Problem& p, const std::vector<bool>& split_row, const std::vector<Problem>& parts) {
  const int64_t d = p.d, S = static_cast<int64_t>(parts.size());
  std::vector<float> acc(d), w(S);
  for (size_t r = 0; r < p.rows.size(); ++r) {
    if (!split_row[r]) continue;
    const Row& row = p.rows[r];
    for (int64_t n = row.q_lo; n < row.q_hi; ++n) {
      for (int64_t head = 0; head < p.heads; ++head) {
        const int64_t li = row.b * p.lse_sb + head * p.lse_n + n, oi = (row.b * p.out_sb + n * p.out_sn + head * d);
        float top = kNegInf;
        for (int64_t s = 0; s < S; ++s) top = std::max(top, parts[s].lse[li]);
        float total = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        if (top != kNegInf) {
          for (int64_t s = 0; s < S; ++s) {
            w[s] = std::exp(parts[s].lse[li] - top);
            total += w[s];
            const float* o = reinterpret_cast<const float*>(parts[s].out) + oi;
            for (int64_t c = 0; c < d; ++c) acc[c] += w[s] * o[c];
          }
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        p.lse[li] = total > 0.f ? top + std::log(total) : kNegInf;
        if (p.out_f32 || !p.bf16_in) {
          float* f = reinterpret_cast<float*>(p.out) + oi;
          for (int64_t c = 0; c < d; ++c) f[c] = acc[c] * inv;
        } else {
          bf16* f = reinterpret_cast<bf16*>(p.out) + oi;
          for (int64_t c = 0; c < d; ++c) f[c] = f32_to_bf16(acc[c] * inv);
        }
      }
    }
  }
}

// q [B, heads, n, d]; keys[t], values[t] [B_t, kv_heads, m_t, d]; rows [R, 6] int64: (batch, q_lo, q_hi, q_pos,
// piece_lo, piece_hi); pieces [P, 5] int64: (tensor, batch, k_lo, k_hi, k_pos). Returns out [B, n, heads, d] (float32
// or q's dtype) and lse [B, heads, n] float32; queries in no row are 0 with lse -inf.
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, at::TensorList keys, at::TensorList values,
                                             const at::Tensor& rows, const at::Tensor& pieces, bool causal,
                                             int64_t window, double scale, bool out_float) {
  TORCH_CHECK(q.device().is_cpu(), "kvr::attention runs on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "kvr::attention takes float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(keys.size() == values.size(), "as many value pieces as key pieces");
  Problem p;
  p.q = strided(q, "q");
  const int64_t B = q.size(0), n = q.size(2);
  p.heads = q.size(1);
  p.d = q.size(3);
  p.kv_heads = keys.empty() ? p.heads : keys[0].size(1);
  TORCH_CHECK(p.kv_heads > 0 && p.heads % p.kv_heads == 0, "query heads ", p.heads, " not a multiple of K,V heads ",
              p.kv_heads);
  p.group = p.heads / p.kv_heads;
  p.causal = causal;
  p.window = window;
  p.scale = static_cast<float>(scale);
  p.bf16_in = q.scalar_type() == at::kBFloat16;
  p.out_f32 = out_float;
  for (size_t t = 0; t < keys.size(); ++t) {
    for (const at::Tensor* x : {&keys[t], &values[t]}) {
      TORCH_CHECK(x->scalar_type() == q.scalar_type(), "K,V pieces must have q's dtype");
      TORCH_CHECK(x->device().is_cpu(), "K,V pieces must be on the CPU");
      TORCH_CHECK(x->dim() == 4 && x->size(1) == p.kv_heads && x->size(3) == p.d,
                  "a K,V piece must be [batch, ", p.kv_heads, ", tokens, ", p.d, "], got ", x->sizes());
    }
    TORCH_CHECK(keys[t].size(2) == values[t].size(2) && keys[t].size(0) == values[t].size(0),
                "a key piece and its value piece differ in shape");
    p.k.push_back(strided(keys[t], "a key piece"));
    p.v.push_back(strided(values[t], "a value piece"));
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(1) == 6, "rows must be int64 [R, 6]");
  TORCH_CHECK(pieces.scalar_type() == at::kLong && pieces.dim() == 2 && pieces.size(1) == 5,
              "pieces must be int64 [P, 5]");
  const auto rc = rows.contiguous();
  const auto pc = pieces.contiguous();
  const int64_t* rr = rc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t i = 0; i < pc.size(0); ++i) {
    Piece x{pp[5 * i], pp[5 * i + 1], pp[5 * i + 2], pp[5 * i + 3], pp[5 * i + 4]};
    TORCH_CHECK(x.t >= 0 && x.t < static_cast<int64_t>(keys.size()), "piece ", i, " names tensor ", x.t);
    TORCH_CHECK(x.b >= 0 && x.b < keys[x.t].size(0), "piece ", i, " names batch ", x.b);
    TORCH_CHECK(0 <= x.k_lo && x.k_lo <= x.k_hi && x.k_hi <= keys[x.t].size(2), "piece ", i, " keys [", x.k_lo,
                ", ", x.k_hi, ") outside ", keys[x.t].size(2));
    p.pieces.push_back(x);
  }
  for (int64_t i = 0; i < rc.size(0); ++i) {
    Row x{rr[6 * i], rr[6 * i + 1], rr[6 * i + 2], rr[6 * i + 3], rr[6 * i + 4], rr[6 * i + 5]};
    TORCH_CHECK(x.b >= 0 && x.b < B, "row ", i, " names batch ", x.b);
    TORCH_CHECK(0 <= x.q_lo && x.q_lo <= x.q_hi && x.q_hi <= n, "row ", i, " queries [", x.q_lo, ", ", x.q_hi,
                ") outside ", n);
    TORCH_CHECK(0 <= x.piece_lo && x.piece_lo <= x.piece_hi && x.piece_hi <= pc.size(0), "row ", i,
                " pieces out of range");
    p.rows.push_back(x);
  }
  const auto out_dtype = out_float ? at::kFloat : q.scalar_type();
  at::Tensor out = at::zeros({B, n, p.heads, p.d}, q.options().dtype(out_dtype));
  at::Tensor lse = at::full({B, p.heads, n}, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat));
  p.out = static_cast<char*>(out.data_ptr());
  p.out_sb = n * p.heads * p.d;
  p.out_sn = p.heads * p.d;
  p.lse = lse.data_ptr<float>();
  p.lse_sb = p.heads * n;
  p.lse_n = n;

  // Rows of kTileMinPositions or more positions take the tile path where it is on; the rest the vector path.
  const bool tiles = tiles_on(p);
  std::vector<bool> tile_row(p.rows.size(), false);
  bool any_tiles = false;
  for (size_t r = 0; r < p.rows.size(); ++r) {
    tile_row[r] = tiles && p.rows[r].q_hi - p.rows[r].q_lo >= kTileMinPositions;
    any_tiles = any_tiles || tile_row[r];
  }
  const auto row_items = [&](const Row& row, int64_t r, bool tile, std::vector<Item>& into) {
    const int64_t block = std::max<int64_t>(1, (tile ? kTileRows : kTargetRows) / p.group);
    const int64_t len = row.q_hi - row.q_lo;
    for (int64_t i0 = 0; i0 < len; i0 += block)
      for (int64_t h = 0; h < p.kv_heads; ++h) into.push_back(Item{r, h, i0, std::min(block, len - i0)});
  };
  std::vector<Item> items;
  for (int64_t r = 0; r < static_cast<int64_t>(p.rows.size()); ++r) row_items(p.rows[r], r, tile_row[r], items);
  // Fewer vector items than twice the threads (a decode step of a few rows after a long prompt): the long rows' keys
  // are split into parts, each part a row of its own problem writing float32 into scratch, run on every thread and
  // merged by their log-sum-exp after.
  const int64_t threads_here = at::get_num_threads();
  int64_t vector_count = 0;
  for (const Item& it : items) vector_count += tile_row[it.row] ? 0 : 1;
  std::vector<bool> split_row(p.rows.size(), false);
  std::vector<Problem> parts;
  std::vector<at::Tensor> part_out, part_lse;
  if (threads_here > 1 && vector_count > 0 && vector_count < 2 * threads_here) {
    const int64_t nparts = std::min<int64_t>(kMaxKeyParts, (2 * threads_here + vector_count - 1) / vector_count);
    for (int64_t s = 0; s < nparts; ++s) {
      Problem ps;
      ps.d = p.d; ps.heads = p.heads; ps.kv_heads = p.kv_heads; ps.group = p.group;
      ps.causal = p.causal; ps.bf16_in = p.bf16_in; ps.out_f32 = true; ps.window = p.window; ps.scale = p.scale;
      ps.q = p.q; ps.k = p.k; ps.v = p.v;
      part_out.push_back(at::zeros({B, n, p.heads, p.d}, q.options().dtype(at::kFloat)));
      part_lse.push_back(at::full({B, p.heads, n}, kNegInf, q.options().dtype(at::kFloat)));
      ps.out = static_cast<char*>(part_out.back().data_ptr());
      ps.out_sb = p.out_sb; ps.out_sn = p.out_sn;
      ps.lse = part_lse.back().data_ptr<float>();
      ps.lse_sb = p.lse_sb; ps.lse_n = p.lse_n;
      parts.push_back(std::move(ps));
    }
    for (size_t r = 0; r < p.rows.size(); ++r) {
      const Row& row = p.rows[r];
      int64_t keys_total = 0;
      for (int64_t pi = row.piece_lo; pi < row.piece_hi; ++pi) keys_total += p.pieces[pi].k_hi - p.pieces[pi].k_lo;
      if (tile_row[r] || keys_total < kSplitMinKeys * nparts) continue;
      split_row[r] = true;
      for (int64_t s = 0; s < nparts; ++s) {  // part s: the row's keys [s K / S, (s + 1) K / S), in piece order
        const int64_t a = keys_total * s / nparts, e = keys_total * (s + 1) / nparts;
        Problem& ps = parts[s];
        Row sub = row;
        sub.piece_lo = static_cast<int64_t>(ps.pieces.size());
        int64_t seen = 0;
        for (int64_t pi = row.piece_lo; pi < row.piece_hi; ++pi) {
          const Piece& pc = p.pieces[pi];
          const int64_t lo = std::max(a, seen), hi = std::min(e, seen + pc.k_hi - pc.k_lo);
          if (lo < hi) ps.pieces.push_back(Piece{pc.t, pc.b, pc.k_lo + lo - seen, pc.k_lo + hi - seen,
                                                 pc.k_pos + lo - seen});
          seen += pc.k_hi - pc.k_lo;
        }
        sub.piece_hi = static_cast<int64_t>(ps.pieces.size());
        ps.rows.push_back(sub);
      }
    }
  }
  // Causal blocks late in a row see the most keys: hand the heaviest out first, pulled by whichever thread is free.
  std::vector<std::pair<const Problem*, Item>> vector_items;
  std::vector<std::vector<Item>> tile_items(p.kv_heads);  // the tile path packs one K,V head at a time
  for (auto it = items.rbegin(); it != items.rend(); ++it) {
    if (tile_row[it->row]) {
      tile_items[it->h].push_back(*it);
    } else if (!split_row[it->row]) {
      vector_items.emplace_back(&p, *it);
    }
  }
  for (Problem& ps : parts) {
    std::vector<Item> sub;
    for (int64_t r = 0; r < static_cast<int64_t>(ps.rows.size()); ++r) row_items(ps.rows[r], r, false, sub);
    for (const Item& it : sub) vector_items.emplace_back(&ps, it);
  }
  const ItemFn fn = pick(p, chosen_isa());
  // Items pulled by whichever thread is free, over one range of them at a time.
  const auto run_all = [&](const auto& todo, auto&& run) {
    std::atomic<int64_t> next{0};
    const int64_t count = static_cast<int64_t>(todo.size());
    const int64_t threads = std::min<int64_t>(threads_here, count);
    if (threads <= 1) {
      for (const auto& it : todo) run(it);
      return;
    }
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < count; i = next++) run(todo[i]);
      if (any_tiles) at::native::cpublas::brgemm_release(true);
    });
  };
  run_all(vector_items, [&](const std::pair<const Problem*, Item>& job) { fn(*job.first, job.second); });
  if (!parts.empty()) merge_parts(p, split_row, parts);
  if (any_tiles) {
    Packed packed;
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      if (tile_items[h].empty()) continue;
      if (p.bf16_in) {
        pack_head<bf16>(p, tile_row, h, packed);
        run_all(tile_items[h], [&](const Item& it) { tiles_item<bf16>(p, packed, it); });
      } else {
        pack_head<float>(p, tile_row, h, packed);
        run_all(tile_items[h], [&](const Item& it) { tiles_item<float>(p, packed, it); });
      }
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {out, lse};
}

}  // namespace kvr

TORCH_LIBRARY(kvr, m) {
  m.def("attention(Tensor q, Tensor[] keys, Tensor[] values, Tensor rows, Tensor pieces, bool causal, int window, "
        "float scale, bool out_float) -> (Tensor, Tensor)");
  m.def("isa() -> str", &kvr::isa);
  m.def("path(bool bfloat16) -> str", &kvr::path);
}

TORCH_LIBRARY_IMPL(kvr, CPU, m) {
  m.impl("attention", &kvr::attention);
}
