// specdecode's CPU kernels: a row-invariant quantized linear layer, attention over k rows, and the whole
// decoder stack in one call (Llama; with the options of Qwen 3 and Gemma 3: query/key norms, sandwich norms,
// GeGLU, sliding-window layers, one RoPE table per layer kind).
//
// The contract (what the tests check): every output row is computed by the same sequence of operations
// whatever else shares the call — how many rows, which requests, which tree — so a k-row pass gives each row
// bitwise the one-row result. How:
//   * activations are quantized per row, per group of the weights (16 or 32 values), to int16 with one float
//     scale: x ≈ d·xq, d = max|x| / 32767;
//   * weights stay in the GGUF file's integers: w = s·(u − o) (symmetric types) or w = s·u + m (Q4_1, K-quants),
//     u unsigned, one (s, m) per group; integer dot products per group are exact in any order;
//   * each output's float accumulation over groups runs in one fixed order (group 0, 1, ...), lanes = outputs;
//   * threads split output columns (linear) or (row, key/value head, key chunk) tasks (attention), never a
//     reduction; attention reduces each row over fixed chunks of ATT_CHUNK logical key positions counted from 0,
//     merged in order, so a row's result depends only on the keys it sees, in order.
// The vector backends (AVX-512, AVX2, portable C) run the same IEEE operations lane by lane (fused multiply-adds
// only where written, -ffp-contract=off), so they give bitwise the same results as each other.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#ifndef SD_NS
#define SD_NS specdecode_kernels
#endif

#if !defined(SD_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define SD_AVX512 1
#include <immintrin.h>
#elif !defined(SD_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SD_AVX2 1
#include <immintrin.h>
#else
#define SD_SCALAR 1
#endif

namespace sd {

constexpr int kLanes = 16;
constexpr int64_t kAttChunk = 128;  // keys per attention partial (part of the numerics: do not change lightly)
constexpr int kMaxRefine = 64;
constexpr int64_t kPrefetchGroups = 16;
// Attention asks for its keys and values ahead from kPrefetchKeysFrom cached keys, in AVX-512 builds only. On a
// 2-core Zen 4 (AVX-512) the requests took a 4,096-key row from 5.18 to 3.85 ms; on a 2-core Zen 3 the AVX2 build
// was never faster with them and 6-27% slower at 1,024 keys (its arithmetic, at half the width, already hides the
// stream): scripts/attention_ab.py. Elsewhere the requests are compiled out.
#if SD_AVX512
constexpr bool kPrefetchKeys = true;
#else
constexpr bool kPrefetchKeys = false;
#endif
constexpr int64_t kPrefetchKeysFrom = 1024;

// ------------------------------------------------------------------------------------------------ 16 lanes

#if SD_AVX512
constexpr int kRowBlock = 8;  // rows sharing one unpacked weight tile
struct VF { __m512 v; };
struct VI { __m512i v; };
struct VW { __m512i v; };  // 32 int16: lane l holds the pair (2l, 2l+1)
static inline VF vf_zero() { return {_mm512_setzero_ps()}; }
static inline VF vf_set(float x) { return {_mm512_set1_ps(x)}; }
static inline VF vf_load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vf_store(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
static inline VF vf_add(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline VF vf_sub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline VF vf_mul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline VF vf_max(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline VF vf_min(VF a, VF b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline VF vf_fma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline VF vf_round(VF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
static inline VF vf_abs(VF a) { return {_mm512_abs_ps(a.v)}; }
static inline VF vf_from_half(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline VF vf_from_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
static inline VF vf_cvt(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
static inline VI vf_to_int(VF a) { return {_mm512_cvtps_epi32(a.v)}; }  // a holds integers already
static inline VF vf_from_bits(VI a) { return {_mm512_castsi512_ps(a.v)}; }
static inline VI vi_zero() { return {_mm512_setzero_si512()}; }
static inline VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
static inline VI vi_sub_const(VI a, int32_t c) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(c))}; }
static inline VI vi_shl23(VI a) { return {_mm512_slli_epi32(a.v, 23)}; }
static inline VI vi_add_const(VI a, int32_t c) { return {_mm512_add_epi32(a.v, _mm512_set1_epi32(c))}; }
static inline VI vi_dot(VI acc, VW w, int32_t pair) {
#ifdef __AVX512VNNI__
  return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(pair))};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(w.v, _mm512_set1_epi32(pair)))};
#endif
}
static inline void vw_nibbles(const uint8_t* p, VW& lo, VW& hi) {
  __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo.v = _mm512_and_si512(b, _mm512_set1_epi16(0x0F));
  hi.v = _mm512_srli_epi16(b, 4);
}
static inline VW vw_bytes(const uint8_t* p) {
  return {_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline void vf_lanes(VF a, float* out) { _mm512_storeu_ps(out, a.v); }
static inline VI vi_quantize(VF a) { return {_mm512_cvtps_epi32(a.v)}; }
static inline void vi_store16(int16_t* p, VI a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a.v));
}
static inline int32_t vi_hsum(VI a) { return _mm512_reduce_add_epi32(a.v); }  // integers: exact in any order
static inline float vf_hmax(VF a) { return _mm512_reduce_max_ps(a.v); }       // max: exact in any order

#elif SD_AVX2
constexpr int kRowBlock = 3;
struct VF { __m256 a, b; };
struct VI { __m256i a, b; };
struct VW { __m256i a, b; };
static inline VF vf_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline VF vf_set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline VF vf_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float* p, VF x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
#define SD_BIN(name, op) \
  static inline VF name(VF x, VF y) { return {op(x.a, y.a), op(x.b, y.b)}; }
SD_BIN(vf_add, _mm256_add_ps)
SD_BIN(vf_sub, _mm256_sub_ps)
SD_BIN(vf_mul, _mm256_mul_ps)
SD_BIN(vf_max, _mm256_max_ps)
SD_BIN(vf_min, _mm256_min_ps)
#undef SD_BIN
static inline VF vf_fma(VF x, VF y, VF z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
static inline VF vf_round(VF x) {
  const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.a, mode), _mm256_round_ps(x.b, mode)};
}
static inline VF vf_abs(VF x) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(x.a, mask), _mm256_and_ps(x.b, mask)};
}
static inline VF vf_from_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline VF vf_from_i8(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
static inline VF vf_cvt(VI x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline VI vf_to_int(VF x) { return {_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)}; }
static inline VF vf_from_bits(VI x) { return {_mm256_castsi256_ps(x.a), _mm256_castsi256_ps(x.b)}; }
static inline VI vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline VI vi_add(VI x, VI y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
static inline VI vi_sub_const(VI x, int32_t c) {
  const __m256i v = _mm256_set1_epi32(c);
  return {_mm256_sub_epi32(x.a, v), _mm256_sub_epi32(x.b, v)};
}
static inline VI vi_shl23(VI x) { return {_mm256_slli_epi32(x.a, 23), _mm256_slli_epi32(x.b, 23)}; }
static inline VI vi_add_const(VI x, int32_t c) {
  const __m256i v = _mm256_set1_epi32(c);
  return {_mm256_add_epi32(x.a, v), _mm256_add_epi32(x.b, v)};
}
static inline VI vi_dot(VI acc, VW w, int32_t pair) {
  const __m256i x = _mm256_set1_epi32(pair);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(w.a, x)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(w.b, x))};
}
static inline void vw_nibbles(const uint8_t* p, VW& lo, VW& hi) {
  const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  const __m256i mask = _mm256_set1_epi16(0x0F);
  lo = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask)};
  hi = {_mm256_srli_epi16(b0, 4), _mm256_srli_epi16(b1, 4)};
}
static inline VW vw_bytes(const uint8_t* p) {
  return {_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
static inline void vf_lanes(VF x, float* out) { vf_store(out, x); }
static inline VI vi_quantize(VF x) { return vf_to_int(x); }
static inline void vi_store16(int16_t* p, VI x) {
  alignas(32) int32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x.a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), x.b);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<int16_t>(lanes[i]);
}
static inline int32_t vi_hsum(VI x) {
  alignas(32) int32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x.a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), x.b);
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += lanes[i];
  return s;
}
static inline float vf_hmax(VF x) {
  alignas(32) float lanes[16];
  vf_store(lanes, x);
  float m = lanes[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, lanes[i]);
  return m;
}

#else  // portable C: the same operations lane by lane
constexpr int kRowBlock = 4;
struct VF { float v[16]; };
struct VI { int32_t v[16]; };
struct VW { int16_t v[32]; };
#define SD_LOOP for (int i = 0; i < 16; ++i)
static inline VF vf_zero() { VF r; SD_LOOP r.v[i] = 0.0f; return r; }
static inline VF vf_set(float x) { VF r; SD_LOOP r.v[i] = x; return r; }
static inline VF vf_load(const float* p) { VF r; SD_LOOP r.v[i] = p[i]; return r; }
static inline void vf_store(float* p, VF a) { SD_LOOP p[i] = a.v[i]; }
static inline VF vf_add(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] + b.v[i]; return r; }
static inline VF vf_sub(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] - b.v[i]; return r; }
static inline VF vf_mul(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] * b.v[i]; return r; }
// max/min as x86 defines them (the second operand when either is NaN or both are zeros)
static inline VF vf_max(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
static inline VF vf_min(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return r; }
static inline VF vf_fma(VF a, VF b, VF c) { VF r; SD_LOOP r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
static inline VF vf_round(VF a) { VF r; SD_LOOP r.v[i] = std::nearbyint(a.v[i]); return r; }
static inline VF vf_abs(VF a) { VF r; SD_LOOP r.v[i] = std::fabs(a.v[i]); return r; }
static inline VF vf_from_half(const uint16_t* p) {
  VF r;
  SD_LOOP r.v[i] = static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
  return r;
}
static inline VF vf_from_i8(const int8_t* p) { VF r; SD_LOOP r.v[i] = static_cast<float>(p[i]); return r; }
static inline VF vf_cvt(VI a) { VF r; SD_LOOP r.v[i] = static_cast<float>(a.v[i]); return r; }
static inline VI vf_to_int(VF a) { VI r; SD_LOOP r.v[i] = static_cast<int32_t>(std::nearbyint(a.v[i])); return r; }
static inline VF vf_from_bits(VI a) { VF r; std::memcpy(r.v, a.v, sizeof r.v); return r; }
static inline VI vi_zero() { VI r; SD_LOOP r.v[i] = 0; return r; }
static inline VI vi_add(VI a, VI b) { VI r; SD_LOOP r.v[i] = a.v[i] + b.v[i]; return r; }
static inline VI vi_sub_const(VI a, int32_t c) { VI r; SD_LOOP r.v[i] = a.v[i] - c; return r; }
static inline VI vi_shl23(VI a) {
  VI r;
  SD_LOOP r.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) << 23);
  return r;
}
static inline VI vi_add_const(VI a, int32_t c) { VI r; SD_LOOP r.v[i] = a.v[i] + c; return r; }
static inline VI vi_dot(VI acc, VW w, int32_t pair) {
  const int32_t x0 = static_cast<int16_t>(pair & 0xFFFF), x1 = static_cast<int16_t>(pair >> 16);
  SD_LOOP acc.v[i] += w.v[2 * i] * x0 + w.v[2 * i + 1] * x1;
  return acc;
}
static inline void vw_nibbles(const uint8_t* p, VW& lo, VW& hi) {
  for (int i = 0; i < 32; ++i) { lo.v[i] = p[i] & 0x0F; hi.v[i] = p[i] >> 4; }
}
static inline VW vw_bytes(const uint8_t* p) { VW r; for (int i = 0; i < 32; ++i) r.v[i] = p[i]; return r; }
static inline void vf_lanes(VF a, float* out) { vf_store(out, a); }
static inline VI vi_quantize(VF a) { return vf_to_int(a); }
static inline void vi_store16(int16_t* p, VI a) { SD_LOOP p[i] = static_cast<int16_t>(a.v[i]); }
static inline int32_t vi_hsum(VI a) { int32_t s = 0; SD_LOOP s += a.v[i]; return s; }
static inline float vf_hmax(VF a) { float m = a.v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]); return m; }
#undef SD_LOOP
#endif

// Sum of 16 lanes in one fixed tree (lane i + lane i+8, then +4, +2, +1), the same in every backend.
static inline float vf_hsum(VF a) {
  alignas(64) float l[16];
  vf_lanes(a, l);
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}

static inline int32_t load_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline int32_t load_pair8(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// exp(x) for x in any range (clamped to [-87, 88]): 2^n · p(r), n = round(x·log2 e), |r| ≤ ln2/2, with Cephes'
// polynomial; the same fused multiply-adds in every backend.
static inline VF vf_exp(VF x) {
  x = vf_min(vf_max(x, vf_set(-87.0f)), vf_set(88.0f));
  const VF n = vf_round(vf_mul(x, vf_set(1.44269504088896341f)));
  VF r = vf_fma(n, vf_set(-0.693359375f), x);
  r = vf_fma(n, vf_set(2.12194440e-4f), r);
  VF p = vf_set(1.9875691500e-4f);
  p = vf_fma(p, r, vf_set(1.3981999507e-3f));
  p = vf_fma(p, r, vf_set(8.3334519073e-3f));
  p = vf_fma(p, r, vf_set(4.1665795894e-2f));
  p = vf_fma(p, r, vf_set(1.6666665459e-1f));
  p = vf_fma(p, r, vf_set(5.0000001201e-1f));
  const VF r2 = vf_mul(r, r);
  p = vf_fma(p, r2, r);
  p = vf_add(p, vf_set(1.0f));
  const VF scale = vf_from_bits(vi_shl23(vi_add_const(vf_to_int(n), 127)));
  return vf_mul(p, scale);
}

static inline float exp_scalar(float x) {
  alignas(64) float l[16];
  vf_lanes(vf_exp(vf_set(x)), l);
  return l[0];
}

// ------------------------------------------------------------------------------------------------ profiling

// Wall time per phase of the decoder and head, accumulated while profiling is on (scripts/profile_runner.py).
enum Phase { kNorm, kMatrices, kRope, kAttention, kActivation, kHead, kRefine, kPhases };
static bool g_profiling = false;
static double g_phase_seconds[kPhases] = {0};

struct PhaseTimer {
  Phase phase;
  std::chrono::steady_clock::time_point start;
  explicit PhaseTimer(Phase p) : phase(p) {
    if (g_profiling) start = std::chrono::steady_clock::now();
  }
  ~PhaseTimer() {
    if (g_profiling) g_phase_seconds[phase] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

// Turn phase timing on or off; return the seconds accumulated per phase since the last call (then reset).
std::vector<double> profile(bool enable) {
  std::vector<double> out(g_phase_seconds, g_phase_seconds + kPhases);
  std::fill(g_phase_seconds, g_phase_seconds + kPhases, 0.0);
  g_profiling = enable;
  return out;
}

// ------------------------------------------------------------------------------------------------ weights

// One matrix [n outputs, k inputs] in tiles of 16 outputs; per tile, group after group of g inputs, in one of
// two layouts. Pairs (int16 activations; int8 ones where vpdpbusd is missing):
//   nibbles: g/4 chunks of 32 bytes; byte 2c+j of chunk q holds u[c][2q+j] (low) and u[c][2(q+g/4)+j] (high);
//   bytes:   g/2 chunks of 32 bytes; byte 2c+j of chunk p holds u[c][2p+j].
// Quads (int8 activations on vpdpbusd builds, see quad_layout):
//   nibbles: g/8 chunks of 64 bytes; byte 4c+j of chunk b holds u[c][8b+j] (low) and u[c][8b+4+j] (high);
//   bytes:   g/4 chunks of 64 bytes; byte 4c+j of chunk q holds u[c][4q+j].
// scales and offsets (asymmetric types only), [tile][group][16], in one of three kinds (ScaleKind): f32; f16; or
// a K-quant's two levels, int8 multipliers per group times f16 factors per super-block of `per` groups (supers and
// super_offsets: [tile][super][16]): s = d·sc, both exact in float32, so bitwise the f32 kind's product.
enum ScaleKind : int { kScaleF32 = 0, kScaleF16 = 1, kScaleSuper = 2 };

struct Matrix {
  int64_t n = 0, k = 0, g = 0, tiles = 0, groups = 0;
  int64_t per = 1, supers = 0;  // kScaleSuper: groups per super-block, super-blocks per tile row
  bool nibbles = false;
  int kind = kScaleF32;
  int32_t sym = -1;    // >= 0: w = s·(u − sym); < 0: w = s·u + offset
  int64_t abits = 16;  // the activations' bits: 16 (the default) or 8 (llama.cpp's numerics, twice the speed)
  at::Tensor packed, scales, offsets, bias, supers_t, super_offsets_t;  // owners of the data below
  const uint8_t* wp = nullptr;
  const void* sp = nullptr;
  const void* op = nullptr;
  const uint16_t* ssp = nullptr;  // kScaleSuper: the f16 factors of the scales and of the offsets
  const uint16_t* sop = nullptr;
  const float* bp = nullptr;
};

struct Layer {
  at::Tensor input_norm, post_norm;  // post_norm: before the MLP
  at::Tensor q_norm, k_norm;  // optional (undefined = none): an RMSNorm over each query / key head before RoPE
  at::Tensor attn_out_norm, mlp_out_norm;  // optional: the attention / MLP output normed before its residual add
  std::vector<std::shared_ptr<const Matrix>> qkv, o, gate_up, down;  // parts, outputs side by side
  int64_t window = 0;  // > 0: a row attends to the last `window` of its visible keys
  int64_t rope = 0;    // which of the decoder call's RoPE tables
  bool gelu = false;   // GeGLU with tanh GELU, else SiLU
};

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<const Matrix>> matrices;
  std::vector<std::shared_ptr<const Layer>> layers;
};

static Registry& registry() {
  static Registry r;
  return r;
}

static std::shared_ptr<const Matrix> matrix_at(int64_t id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(r.matrices.size()) && r.matrices[id], "no kernel matrix ", id);
  return r.matrices[id];
}

static std::shared_ptr<const Layer> layer_at(int64_t id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(r.layers.size()) && r.layers[id], "no kernel layer ", id);
  return r.layers[id];
}

int64_t register_matrix(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                        const c10::optional<at::Tensor>& bias, int64_t n, int64_t k, int64_t g, bool nibbles,
                        int64_t sym, int64_t abits, const c10::optional<at::Tensor>& supers,
                        const c10::optional<at::Tensor>& super_offsets, int64_t per) {
  TORCH_CHECK(g == 16 || g == 32, "group size must be 16 or 32");
  TORCH_CHECK(abits == 8 || abits == 16, "activation bits must be 8 or 16");
  TORCH_CHECK(k % g == 0 && n > 0, "bad matrix shape");
  auto m = std::make_shared<Matrix>();
  m->n = n;
  m->k = k;
  m->g = g;
  m->tiles = (n + kLanes - 1) / kLanes;
  m->groups = k / g;
  m->nibbles = nibbles;
  m->sym = static_cast<int32_t>(sym);
  m->abits = abits;
  m->packed = packed.contiguous();
  TORCH_CHECK(m->packed.scalar_type() == at::kByte, "packed weights must be uint8");
  TORCH_CHECK(m->packed.numel() == m->tiles * kLanes * k / (nibbles ? 2 : 1), "packed weights have the wrong size");
  m->scales = scales.contiguous();
  const auto st = m->scales.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kFloat || (st == at::kChar && supers.has_value()),
              "scales: f16, f32, or int8 with f16 super-block factors");
  TORCH_CHECK(m->scales.numel() == m->tiles * m->groups * kLanes, "scales have the wrong size");
  m->kind = st == at::kChar ? kScaleSuper : st == at::kHalf ? kScaleF16 : kScaleF32;
  if (m->kind == kScaleSuper) {
    TORCH_CHECK(per >= 1 && m->groups % per == 0, "super-blocks must hold whole groups");
    m->per = per;
    m->supers = m->groups / per;
    m->supers_t = supers->contiguous();
    TORCH_CHECK(m->supers_t.scalar_type() == at::kHalf && m->supers_t.numel() == m->tiles * m->supers * kLanes,
                "super-block factors: f16 [tiles, groups / per, 16]");
    m->ssp = reinterpret_cast<const uint16_t*>(m->supers_t.data_ptr());
  }
  if (sym < 0) {
    TORCH_CHECK(offsets.has_value(), "an asymmetric matrix needs offsets");
    m->offsets = offsets->contiguous();
    TORCH_CHECK(m->offsets.scalar_type() == st && m->offsets.numel() == m->scales.numel(),
                "offsets: the scales' dtype and size");
    if (m->kind == kScaleSuper) {
      TORCH_CHECK(super_offsets.has_value(), "two-level offsets need their super-block factors");
      m->super_offsets_t = super_offsets->contiguous();
      TORCH_CHECK(m->super_offsets_t.scalar_type() == at::kHalf && m->super_offsets_t.numel() == m->supers_t.numel(),
                  "super-block offset factors: the scale factors' dtype and size");
      m->sop = reinterpret_cast<const uint16_t*>(m->super_offsets_t.data_ptr());
    }
  }
  if (bias.has_value()) {
    m->bias = bias->contiguous();
    TORCH_CHECK(m->bias.scalar_type() == at::kFloat && m->bias.numel() == n, "bias: float32 [n]");
  }
  m->wp = m->packed.data_ptr<uint8_t>();
  m->sp = m->scales.data_ptr();
  m->op = m->offsets.defined() ? m->offsets.data_ptr() : nullptr;
  m->bp = m->bias.defined() ? m->bias.data_ptr<float>() : nullptr;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.matrices.push_back(std::move(m));
  return static_cast<int64_t>(r.matrices.size()) - 1;
}

// ------------------------------------------------------------------------------------------------ repacking

// A GGUF file's block rows decoded straight into the tile layout (Matrix): the loader's fast path, bitwise what
// gguf_blocks.py's numpy decoders and weights._tile_layout give (tests/test_kernels.py checks every type).
struct BlockFormat {
  int64_t elements, bytes;  // per block
  int64_t g, per;           // kernel group; groups per super-block (1: one-level f16 scales)
  bool nibbles, offsets;
};

static BlockFormat block_format(const std::string& kind) {
  if (kind == "Q4_0") return {32, 18, 32, 1, true, false};
  if (kind == "Q4_1") return {32, 20, 32, 1, true, true};
  if (kind == "Q5_0") return {32, 22, 32, 1, false, false};
  if (kind == "Q5_1") return {32, 24, 32, 1, false, true};
  if (kind == "Q8_0") return {32, 34, 32, 1, false, false};
  if (kind == "Q4_K") return {256, 144, 32, 8, true, true};
  if (kind == "Q5_K") return {256, 176, 32, 8, false, true};
  if (kind == "Q6_K") return {256, 210, 16, 16, false, false};
  TORCH_CHECK(false, "no repacking for block type ", kind);
}

static inline uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// One block's integers u[elements] and, per group, its scale and offset fields: f16 bits (one-level types) or the
// int8 multipliers sc/mn (K-quants, whose f16 factors d and -dmin come back in super_d/super_m).
static void decode_block(const std::string& kind, const uint8_t* b, uint8_t* u, uint16_t* half_s, uint16_t* half_m,
                         int8_t* sc, int8_t* mn, uint16_t& super_d, uint16_t& super_m) {
  if (kind == "Q4_0" || kind == "Q4_1") {
    const int at = kind == "Q4_0" ? 2 : 4;
    for (int l = 0; l < 16; ++l) {
      u[l] = b[at + l] & 15;
      u[l + 16] = b[at + l] >> 4;
    }
    half_s[0] = load_u16(b);
    if (kind == "Q4_1") half_m[0] = load_u16(b + 2);
  } else if (kind == "Q5_0" || kind == "Q5_1") {
    const int qh_at = kind == "Q5_0" ? 2 : 4, qs_at = qh_at + 4;
    const uint32_t qh = b[qh_at] | (b[qh_at + 1] << 8) | (b[qh_at + 2] << 16) | (static_cast<uint32_t>(b[qh_at + 3]) << 24);
    for (int l = 0; l < 16; ++l) {
      u[l] = (b[qs_at + l] & 15) | (((qh >> l) & 1) << 4);
      u[l + 16] = (b[qs_at + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
    }
    half_s[0] = load_u16(b);
    if (kind == "Q5_1") half_m[0] = load_u16(b + 2);
  } else if (kind == "Q8_0") {
    for (int l = 0; l < 32; ++l) u[l] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + l]) + 128);
    half_s[0] = load_u16(b);
  } else if (kind == "Q4_K" || kind == "Q5_K") {
    super_d = load_u16(b);
    super_m = load_u16(b + 2) ^ 0x8000;  // −dmin: negating a float16 flips its sign bit
    const uint8_t* q = b + 4;
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        sc[j] = static_cast<int8_t>(q[j] & 63);
        mn[j] = static_cast<int8_t>(q[j + 4] & 63);
      } else {
        sc[j] = static_cast<int8_t>((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        mn[j] = static_cast<int8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
      }
    }
    const bool five = kind == "Q5_K";
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (five ? 48 : 16);
    for (int i = 0; i < 4; ++i)
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          uint8_t v = h ? qs[32 * i + l] >> 4 : qs[32 * i + l] & 15;
          if (five) v |= ((qh[l] >> (2 * i + h)) & 1) << 4;
          u[64 * i + 32 * h + l] = v;
        }
  } else {  // Q6_K
    const uint8_t* ql0 = b;
    const uint8_t* qh0 = b + 128;
    for (int j = 0; j < 16; ++j) sc[j] = static_cast<int8_t>(b[192 + j]);
    super_d = load_u16(b + 208);
    for (int hh = 0; hh < 2; ++hh) {
      const uint8_t* ql = ql0 + 64 * hh;
      const uint8_t* qh = qh0 + 32 * hh;
      uint8_t* o = u + 128 * hh;
      for (int l = 0; l < 32; ++l) {
        o[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
        o[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
        o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
  }
}

// Rows of raw blocks ([rows, bytes per row], uint8) as output rows row0.. of a matrix whose tile-layout buffers are
// given (packed zeroed for nibbles; scales/offsets f16, or int8 with f16 supers/super_offsets for K-quants).
void repack_rows(const at::Tensor& raw, const std::string& kind, int64_t row0, int64_t k, bool quads,
                 const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                 const c10::optional<at::Tensor>& supers, const c10::optional<at::Tensor>& super_offsets) {
  const BlockFormat f = block_format(kind);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "raw blocks: uint8 [rows, bytes]");
  TORCH_CHECK(k % f.elements == 0 && raw.size(1) == k / f.elements * f.bytes, "raw blocks: the wrong row size");
  TORCH_CHECK(f.offsets == offsets.has_value() && (f.per > 1) == supers.has_value(), "repack: the type's fields");
  const int64_t rows = raw.size(0), g = f.g, groups = k / g, blocks = k / f.elements, gpb = f.elements / g;
  const int64_t group_bytes = f.nibbles ? g * 8 : g * 16, half = g / 2, n_supers = f.per > 1 ? groups / f.per : 0;
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  void* sp = scales.data_ptr();
  void* op = offsets.has_value() ? offsets->data_ptr() : nullptr;
  uint16_t* ssp = supers.has_value() ? reinterpret_cast<uint16_t*>(supers->data_ptr()) : nullptr;
  uint16_t* sop = super_offsets.has_value() ? reinterpret_cast<uint16_t*>(super_offsets->data_ptr()) : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> u(f.elements);
    int8_t sc[16], mn[16];
    uint16_t hs = 0, hm = 0, sd = 0, sm = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = row0 + r, t = n / kLanes, c = n % kLanes;
      for (int64_t bi = 0; bi < blocks; ++bi) {
        decode_block(kind, rp + r * raw.size(1) + bi * f.bytes, u.data(), &hs, &hm, sc, mn, sd, sm);
        for (int64_t gj = 0; gj < gpb; ++gj) {
          const int64_t j = bi * gpb + gj, at = (t * groups + j) * kLanes + c;
          uint8_t* base = pp + (t * groups + j) * group_bytes;
          const uint8_t* v = u.data() + gj * g;
          for (int64_t i = 0; i < g; ++i) {
            if (quads && f.nibbles) {
              base[(i / 8) * 64 + 4 * c + i % 4] |= static_cast<uint8_t>(v[i] << (i % 8 < 4 ? 0 : 4));
            } else if (quads) {
              base[(i / 4) * 64 + 4 * c + i % 4] = v[i];
            } else if (f.nibbles) {
              const int64_t e = i < half ? i : i - half;
              base[(e / 2) * 32 + 2 * c + e % 2] |= static_cast<uint8_t>(v[i] << (i < half ? 0 : 4));
            } else {
              base[(i / 2) * 32 + 2 * c + i % 2] = v[i];
            }
          }
          if (f.per > 1) {
            static_cast<int8_t*>(sp)[at] = sc[gj];
            if (op != nullptr) static_cast<int8_t*>(op)[at] = mn[gj];
          } else {
            static_cast<uint16_t*>(sp)[at] = hs;
            if (op != nullptr) static_cast<uint16_t*>(op)[at] = hm;
          }
        }
        if (f.per > 1) {
          const int64_t at = (t * n_supers + bi) * kLanes + c;
          ssp[at] = sd;
          if (sop != nullptr) sop[at] = sm;
        }
      }
    }
  });
}

static std::vector<std::shared_ptr<const Matrix>> parts_of(at::IntArrayRef ids) {
  std::vector<std::shared_ptr<const Matrix>> parts;
  for (int64_t id : ids) parts.push_back(matrix_at(id));
  TORCH_CHECK(!parts.empty(), "a layer linear needs at least one matrix");
  for (const auto& p : parts) TORCH_CHECK(p->k == parts[0]->k, "parts of a linear must share their input size");
  return parts;
}

static at::Tensor optional_norm(const c10::optional<at::Tensor>& w) {
  return w.has_value() ? w->to(at::kFloat).contiguous() : at::Tensor();
}

int64_t register_layer(const at::Tensor& input_norm, at::IntArrayRef qkv, at::IntArrayRef o, const at::Tensor& post_norm,
                       at::IntArrayRef gate_up, at::IntArrayRef down, const c10::optional<at::Tensor>& q_norm,
                       const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& attn_out_norm,
                       const c10::optional<at::Tensor>& mlp_out_norm, int64_t window, int64_t rope, bool gelu) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "query and key norms come together");
  TORCH_CHECK(window >= 0 && rope >= 0, "window and rope must be >= 0");
  auto layer = std::make_shared<Layer>();
  layer->input_norm = input_norm.to(at::kFloat).contiguous();
  layer->post_norm = post_norm.to(at::kFloat).contiguous();
  layer->q_norm = optional_norm(q_norm);
  layer->k_norm = optional_norm(k_norm);
  layer->attn_out_norm = optional_norm(attn_out_norm);
  layer->mlp_out_norm = optional_norm(mlp_out_norm);
  layer->window = window;
  layer->rope = rope;
  layer->gelu = gelu;
  layer->qkv = parts_of(qkv);
  layer->o = parts_of(o);
  layer->gate_up = parts_of(gate_up);
  layer->down = parts_of(down);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.layers.push_back(std::move(layer));
  return static_cast<int64_t>(r.layers.size()) - 1;
}

void release(int64_t matrix, int64_t layer) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (matrix >= 0 && matrix < static_cast<int64_t>(r.matrices.size())) r.matrices[matrix].reset();
  if (layer >= 0 && layer < static_cast<int64_t>(r.layers.size())) r.layers[layer].reset();
}

// ------------------------------------------------------------------------------------------------ activations

#if SD_AVX512 && defined(__AVX512VNNI__)
#define SD_DOT8 1  // int8 activations run on vpdpbusd (4 products per lane); elsewhere on the int16 path, same sums
#else
#define SD_DOT8 0
#endif

// Rows quantized per group of g to `bits` (16 or 8) bits: x ≈ d·q, d = max|x| / (2^(bits−1) − 1); sum = Σq per
// group (exact integers). int16 values go to q; 8-bit ones on vpdpbusd builds to q8 instead.
struct QuantRows {
  int64_t rows = 0, k = 0, g = 0, groups = 0, bits = 16;
  std::vector<int16_t> q;
  std::vector<int8_t> q8;
  std::vector<float> d, dsum;  // dsum = d · float(sum)
  std::vector<int32_t> sum;
  bool packed8() const { return SD_DOT8 && bits == 8; }
};

static void quantize_group(const float* x, int64_t g, int64_t bits, int16_t* q, int8_t* q8, float& d, int32_t& sum) {
  VF amax = vf_zero();
  for (int64_t i = 0; i < g; i += kLanes) amax = vf_max(amax, vf_abs(vf_load(x + i)));
  const float m = vf_hmax(amax);
  if (!(m > 0.0f) || !std::isfinite(m)) {  // all zeros (or non-finite input: poisoned, as the float path would be)
    if (q != nullptr) std::fill(q, q + g, 0);
    if (q8 != nullptr) std::fill(q8, q8 + g, 0);
    d = m > 0.0f ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    sum = 0;
    return;
  }
  const float top = bits == 8 ? 127.0f : 32767.0f;
  const float inv = top / m;
  d = m / top;
  alignas(64) int16_t values[32];
  VI s = vi_zero();
  for (int64_t i = 0; i < g; i += kLanes) {
    VF v = vf_mul(vf_load(x + i), vf_set(inv));
    v = vf_min(vf_max(vf_round(v), vf_set(-top)), vf_set(top));
    const VI iv = vi_quantize(v);
    vi_store16(q != nullptr ? q + i : values + i, iv);
    s = vi_add(s, iv);
  }
  sum = vi_hsum(s);
  if (q8 != nullptr)
    for (int64_t i = 0; i < g; ++i) q8[i] = static_cast<int8_t>(values[i]);
}

static void quantize_rows(const float* x, int64_t ldx, int64_t rows, int64_t k, int64_t g, int64_t bits,
                          QuantRows& out) {
  out.rows = rows;
  out.k = k;
  out.g = g;
  out.bits = bits;
  out.groups = k / g;
  if (out.packed8()) {
    out.q8.resize(rows * k);
  } else {
    out.q.resize(rows * k);
  }
  out.d.resize(rows * out.groups);
  out.dsum.resize(rows * out.groups);
  out.sum.resize(rows * out.groups);
  const int64_t groups = out.groups;
  const bool packed = out.packed8();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < groups; ++j) {
        const int64_t at = r * groups + j, offset = r * k + j * g;
        quantize_group(x + r * ldx + j * g, g, bits, packed ? nullptr : out.q.data() + offset,
                       packed ? out.q8.data() + offset : nullptr, out.d[at], out.sum[at]);
        out.dsum[at] = out.d[at] * static_cast<float>(out.sum[at]);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------ linear

// The 16 lanes' scales (or offsets) of one group: `at` indexes the group's lanes, `super_at` its super-block's.
template <int SK>
static inline VF load_scales(const void* p, const uint16_t* super, int64_t at, int64_t super_at) {
  if constexpr (SK == kScaleSuper) {
    return vf_mul(vf_from_half(super + super_at), vf_from_i8(static_cast<const int8_t*>(p) + at));
  } else if constexpr (SK == kScaleF16) {
    return vf_from_half(static_cast<const uint16_t*>(p) + at);
  } else {
    return vf_load(static_cast<const float*>(p) + at);
  }
}

template <int SK>
constexpr int64_t kScaleBytes = SK == kScaleSuper ? 1 : SK == kScaleF16 ? 2 : 4;

#if SD_DOT8
static inline VI vi_dot8(VI acc, __m512i w, int32_t quad) {
  return {_mm512_dpbusd_epi32(acc.v, w, _mm512_set1_epi32(quad))};
}
#endif

// y[r, col0 + c] (+)= Σ_groups (s·(d·Σ u·xq − ...)) for R rows and one tile of 16 outputs. A8: the activations
// are int8 quads (vpdpbusd); otherwise int16 pairs.
template <int R, int G, bool NIB, int SK, bool SYM, bool A8>
static void tile_rows(const Matrix& w, int64_t t, const QuantRows& x, int64_t r0, float* y, int64_t ldy,
                      int64_t ncols, const float* add, int64_t ldadd) {
  VF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vf_zero();
  const int64_t groups = w.groups;
  constexpr int64_t group_bytes = NIB ? G * 8 : G * 16;
  const uint8_t* wp = w.wp + t * groups * group_bytes;
  const int64_t sbase = t * groups * kLanes;
  const int64_t super_base = t * w.supers * kLanes;
  const int16_t* xrow[R];
  const int8_t* xrow8[R];
  for (int r = 0; r < R; ++r) {
    if constexpr (A8) {
      xrow8[r] = x.q8.data() + (r0 + r) * x.k;
    } else {
      xrow[r] = x.q.data() + (r0 + r) * x.k;
    }
  }
  // Few rows: two integer accumulators per row (exact, so the split changes nothing but latency).
  constexpr bool kSplit = R <= 4;
  for (int64_t j = 0; j < groups; ++j) {
    VI ia[R], ib[R];
    for (int r = 0; r < R; ++r) ia[r] = ib[r] = vi_zero();
    const int64_t k0 = j * G;
    // Streaming weights from memory (one row: bandwidth-bound): fetch ~16 groups ahead of use.
    for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(wp + kPrefetchGroups * group_bytes + at);
    __builtin_prefetch(static_cast<const char*>(w.sp) + (sbase + (j + kPrefetchGroups) * kLanes) * kScaleBytes<SK>);
    if (!SYM)
      __builtin_prefetch(static_cast<const char*>(w.op) + (sbase + (j + kPrefetchGroups) * kLanes) * kScaleBytes<SK>);
    if constexpr (A8) {  // the quad layout: 16 lanes of 4 consecutive inputs per 64 bytes
#if SD_DOT8
      if constexpr (NIB) {
        const __m512i mask = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
        for (int b = 0; b < G / 8; ++b) {
          const __m512i v = _mm512_loadu_si512(wp + b * 64);
          const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
          for (int r = 0; r < R; ++r) ia[r] = vi_dot8(ia[r], lo, load_pair8(xrow8[r] + k0 + 8 * b));
          for (int r = 0; r < R; ++r) {
            if constexpr (kSplit) {
              ib[r] = vi_dot8(ib[r], hi, load_pair8(xrow8[r] + k0 + 8 * b + 4));
            } else {
              ia[r] = vi_dot8(ia[r], hi, load_pair8(xrow8[r] + k0 + 8 * b + 4));
            }
          }
        }
      } else {
#pragma GCC unroll 8
        for (int q = 0; q < G / 4; q += 2) {
          const __m512i v0 = _mm512_loadu_si512(wp + q * 64), v1 = _mm512_loadu_si512(wp + (q + 1) * 64);
          for (int r = 0; r < R; ++r) ia[r] = vi_dot8(ia[r], v0, load_pair8(xrow8[r] + k0 + 4 * q));
          for (int r = 0; r < R; ++r) {
            if constexpr (kSplit) {
              ib[r] = vi_dot8(ib[r], v1, load_pair8(xrow8[r] + k0 + 4 * (q + 1)));
            } else {
              ia[r] = vi_dot8(ia[r], v1, load_pair8(xrow8[r] + k0 + 4 * (q + 1)));
            }
          }
        }
      }
#endif
    } else if constexpr (NIB) {
      constexpr int kQuarter = G / 4;
#pragma GCC unroll 8
      for (int c = 0; c < kQuarter; ++c) {
        VW lo, hi;
        vw_nibbles(wp + c * 32, lo, hi);
        for (int r = 0; r < R; ++r) ia[r] = vi_dot(ia[r], lo, load_pair(xrow[r] + k0 + 2 * c));
        for (int r = 0; r < R; ++r) {
          if constexpr (kSplit) {
            ib[r] = vi_dot(ib[r], hi, load_pair(xrow[r] + k0 + 2 * (c + kQuarter)));
          } else {
            ia[r] = vi_dot(ia[r], hi, load_pair(xrow[r] + k0 + 2 * (c + kQuarter)));
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int p = 0; p < G / 2; p += 2) {
        const VW b0 = vw_bytes(wp + p * 32), b1 = vw_bytes(wp + (p + 1) * 32);
        for (int r = 0; r < R; ++r) ia[r] = vi_dot(ia[r], b0, load_pair(xrow[r] + k0 + 2 * p));
        for (int r = 0; r < R; ++r) {
          if constexpr (kSplit) {
            ib[r] = vi_dot(ib[r], b1, load_pair(xrow[r] + k0 + 2 * (p + 1)));
          } else {
            ia[r] = vi_dot(ia[r], b1, load_pair(xrow[r] + k0 + 2 * (p + 1)));
          }
        }
      }
    }
    if constexpr (kSplit)
      for (int r = 0; r < R; ++r) ia[r] = vi_add(ia[r], ib[r]);
    wp += group_bytes;
    const int64_t si = sbase + j * kLanes;
    const int64_t ssi = SK == kScaleSuper ? super_base + (j / w.per) * kLanes : 0;
    const VF s = load_scales<SK>(w.sp, w.ssp, si, ssi);
    if (SYM) {
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.groups + j;
        const VI centred = vi_sub_const(ia[r], w.sym * x.sum[at]);
        acc[r] = vf_fma(vf_mul(vf_cvt(centred), vf_set(x.d[at])), s, acc[r]);
      }
    } else {
      const VF off = load_scales<SK>(w.op, w.sop, si, ssi);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.groups + j;
        acc[r] = vf_fma(vf_mul(vf_cvt(ia[r]), vf_set(x.d[at])), s, acc[r]);
        acc[r] = vf_fma(off, vf_set(x.dsum[at]), acc[r]);
      }
    }
  }
  const int64_t col0 = t * kLanes;
  const int64_t width = std::min<int64_t>(kLanes, ncols - col0);
  alignas(64) float lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    VF out = acc[r];
    if (w.bp != nullptr) {
      alignas(64) float b[kLanes] = {0};
      for (int64_t c = 0; c < width; ++c) b[c] = w.bp[col0 + c];
      out = vf_add(out, vf_load(b));
    }
    float* dst = y + (r0 + r) * ldy + col0;
    if (add != nullptr) {
      const float* src = add + (r0 + r) * ldadd + col0;
      if (width == kLanes) {
        out = vf_add(vf_load(src), out);
      } else {
        alignas(64) float a[kLanes] = {0};
        for (int64_t c = 0; c < width; ++c) a[c] = src[c];
        out = vf_add(vf_load(a), out);
      }
    }
    if (width == kLanes) {
      vf_store(dst, out);
    } else {
      vf_lanes(out, lanes);
      for (int64_t c = 0; c < width; ++c) dst[c] = lanes[c];
    }
  }
}

template <bool NIB, int SK, bool SYM, bool A8>
static void tile_any(int rows, const Matrix& w, int64_t t, const QuantRows& x, int64_t r0, float* y, int64_t ldy,
                     int64_t ncols, const float* add, int64_t ldadd) {
  switch (rows) {
#define SD_CASE(n)                                                              \
  case n:                                                                       \
    if (w.g == 16) return tile_rows<n, 16, NIB, SK, SYM, A8>(w, t, x, r0, y, ldy, ncols, add, ldadd); \
    return tile_rows<n, 32, NIB, SK, SYM, A8>(w, t, x, r0, y, ldy, ncols, add, ldadd);
    SD_CASE(1)
    SD_CASE(2)
    SD_CASE(3)
#if SD_AVX512 || SD_SCALAR
    SD_CASE(4)
#endif
#if SD_AVX512
    SD_CASE(5)
    SD_CASE(6)
    SD_CASE(7)
    SD_CASE(8)
#endif
#undef SD_CASE
    default:
      TORCH_CHECK(false, "row block out of range");
  }
}

using TileFn = void (*)(int, const Matrix&, int64_t, const QuantRows&, int64_t, float*, int64_t, int64_t, const float*,
                        int64_t);

template <bool A8>
static TileFn tile_fn_of(const Matrix& w) {
  const int key = (w.nibbles ? 6 : 0) + w.kind * 2 + (w.sym >= 0 ? 1 : 0);
  static const TileFn table[12] = {
      tile_any<false, kScaleF32, false, A8>,   tile_any<false, kScaleF32, true, A8>,
      tile_any<false, kScaleF16, false, A8>,   tile_any<false, kScaleF16, true, A8>,
      tile_any<false, kScaleSuper, false, A8>, tile_any<false, kScaleSuper, true, A8>,
      tile_any<true, kScaleF32, false, A8>,    tile_any<true, kScaleF32, true, A8>,
      tile_any<true, kScaleF16, false, A8>,    tile_any<true, kScaleF16, true, A8>,
      tile_any<true, kScaleSuper, false, A8>,  tile_any<true, kScaleSuper, true, A8>,
  };
  return table[key];
}

static TileFn tile_fn(const Matrix& w, const QuantRows& x) {
  return x.packed8() ? tile_fn_of<true>(w) : tile_fn_of<false>(w);
}

// y[:, :ncols] (+ add) = x̂ @ W.T for the quantized rows x̂ (ncols ≤ w.n: a head may stop at the vocabulary).
static void linear_rows(const Matrix& w, const QuantRows& x, float* y, int64_t ldy, int64_t ncols, const float* add,
                        int64_t ldadd) {
  TORCH_CHECK(x.bits == w.abits && x.g == w.g, "activations quantized for another matrix");
  const TileFn fn = tile_fn(w, x);
  const int64_t tiles = (ncols + kLanes - 1) / kLanes;
  const int64_t rows = x.rows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int block = static_cast<int>(std::min<int64_t>(kRowBlock, rows - r0));
        fn(block, w, t, x, r0, y, ldy, ncols, add, ldadd);
      }
    }
  });
}

// A layer's linear: its parts side by side, each fed the input quantized per its own group size.
struct Inputs {
  QuantRows quantized[2][2];  // [group 16 / 32][8 / 16 bits]
  bool have[2][2] = {{false, false}, {false, false}};
};

static const QuantRows& quantized(Inputs& in, const float* x, int64_t ldx, int64_t rows, const Matrix& w) {
  const int gi = w.g == 32, bi = w.abits == 16;
  if (!in.have[gi][bi]) {
    quantize_rows(x, ldx, rows, w.k, w.g, w.abits, in.quantized[gi][bi]);
    in.have[gi][bi] = true;
  }
  return in.quantized[gi][bi];
}

static void apply_parts(const std::vector<std::shared_ptr<const Matrix>>& parts, const float* x, int64_t ldx,
                        int64_t rows, float* y, int64_t ldy, const float* add, int64_t ldadd) {
  Inputs in;
  int64_t col = 0;
  for (const auto& part : parts) {
    const QuantRows& q = quantized(in, x, ldx, rows, *part);
    linear_rows(*part, q, y + col, ldy, part->n, add == nullptr ? nullptr : add + col, ldadd);
    col += part->n;
  }
}

static int64_t width_of(const std::vector<std::shared_ptr<const Matrix>>& parts) {
  int64_t n = 0;
  for (const auto& p : parts) n += p->n;
  return n;
}

at::Tensor linear(const at::Tensor& x, at::IntArrayRef ids) {
  const auto parts = parts_of(ids);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == parts[0]->k, "linear: x must be [rows, ", parts[0]->k, "]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), width_of(parts)}, xf.options());
  apply_parts(parts, xf.data_ptr<float>(), xf.size(1), xf.size(0), y.data_ptr<float>(), y.size(1), nullptr, 0);
  return y;
}

// ------------------------------------------------------------------------------------------------ small ops

// y = (x · 1/sqrt(mean(x²) + eps)) · w, the sum of squares in 16 lanes then the fixed tree.
static void rms_norm_rows(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    VF ss = vf_zero();
    for (int64_t i = 0; i < n; i += kLanes) {
      const VF v = vf_load(xr + i);
      ss = vf_fma(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(vf_hsum(ss) / static_cast<float>(n) + eps);
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; i += kLanes) vf_store(yr + i, vf_mul(vf_mul(vf_load(xr + i), vf_set(inv)), vf_load(w + i)));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wf = w.to(at::kFloat).contiguous();
  TORCH_CHECK(xf.dim() == 2 && xf.size(1) % kLanes == 0 && wf.numel() == xf.size(1), "rms_norm: bad shapes");
  at::Tensor y = at::empty_like(xf);
  rms_norm_rows(xf.data_ptr<float>(), xf.size(0), xf.size(1), wf.data_ptr<float>(), static_cast<float>(eps),
                y.data_ptr<float>());
  return y;
}

// x·cos + swap_halves(x)·signed_sin per head (transformers' rotate_half, its sign folded into the table), with
// row r's table rows cos[r] / sin[r].
static void rope_rows(float* x, int64_t rows, int64_t heads, int64_t ld, int64_t d, const float* const* cos,
                      const float* const* sin) {
  const int64_t half = d / 2;
  float tmp[256];
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos[r];
    const float* s = sin[r];
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * ld + h * d;
      for (int64_t i = 0; i < half; ++i) tmp[i] = v[i] * c[i] + v[i + half] * s[i];
      for (int64_t i = half; i < d; ++i) tmp[i] = v[i] * c[i] + v[i - half] * s[i];
      std::memcpy(v, tmp, d * sizeof(float));
    }
  }
}

// a = silu(gate) · up = gate / (1 + exp(−gate)) · up
static void silu_mul_rows(const float* gu, int64_t rows, int64_t inter, float* a) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gu + r * 2 * inter;
    const float* up = gate + inter;
    float* out = a + r * inter;
    for (int64_t i = 0; i < inter; i += kLanes) {
      const VF gv = vf_load(gate + i);
      const VF e = vf_exp(vf_sub(vf_zero(), gv));
      alignas(64) float num[kLanes], den[kLanes], upl[kLanes];
      vf_lanes(gv, num);
      vf_lanes(vf_add(vf_set(1.0f), e), den);
      vf_lanes(vf_load(up + i), upl);
      for (int l = 0; l < kLanes; ++l) out[i + l] = (num[l] / den[l]) * upl[l];
    }
  }
}

// a = gelu_tanh(gate) · up, gelu_tanh(g) = g/2 · (1 + tanh(√(2/π)·(g + 0.044715·g³))), tanh(y) = 1 − 2/(e^{2y} + 1)
static void gelu_mul_rows(const float* gu, int64_t rows, int64_t inter, float* a) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gu + r * 2 * inter;
    const float* up = gate + inter;
    float* out = a + r * inter;
    for (int64_t i = 0; i < inter; i += kLanes) {
      const VF g = vf_load(gate + i);
      const VF inner = vf_mul(vf_set(beta), vf_add(g, vf_mul(vf_set(kappa), vf_mul(vf_mul(g, g), g))));
      const VF e = vf_exp(vf_add(inner, inner));
      alignas(64) float gl[kLanes], den[kLanes], upl[kLanes];
      vf_lanes(g, gl);
      vf_lanes(vf_add(e, vf_set(1.0f)), den);
      vf_lanes(vf_load(up + i), upl);
      for (int l = 0; l < kLanes; ++l) {
        const float t = 1.0f - 2.0f / den[l];
        out[i + l] = (0.5f * gl[l] * (1.0f + t)) * upl[l];
      }
    }
  }
}

// An RMSNorm over each of `heads` heads of d values (row r's heads at x + r·ld), in place.
static void norm_heads(float* x, int64_t rows, int64_t heads, int64_t ld, int64_t d, const float* w, float eps) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) rms_norm_rows(x + r * ld + h * d, 1, d, w, eps, x + r * ld + h * d);
}

// ------------------------------------------------------------------------------------------------ attention

// Rows of one call: which cache they use, the slot their key/value goes to, and what they see: logical key
// positions 0..prefix-1 are slots 0..prefix-1, then extra slots (a tree row's ancestors and itself).
struct RowsView {
  const int32_t* meta;           // [rows][4]: cache, write slot, position (the RoPE table's row), prefix
  const int64_t* extra_offsets;  // [rows + 1], or null: no row has extras
  const int64_t* extra_slots;
  int64_t rows;
  int64_t cache(int64_t r) const { return meta[4 * r]; }
  int64_t slot(int64_t r) const { return meta[4 * r + 1]; }
  int64_t position(int64_t r) const { return meta[4 * r + 2]; }
  int64_t prefix(int64_t r) const { return meta[4 * r + 3]; }
  int64_t extras(int64_t r) const { return extra_offsets == nullptr ? 0 : extra_offsets[r + 1] - extra_offsets[r]; }
  int64_t visible(int64_t r) const { return prefix(r) + extras(r); }
  int64_t slot_of(int64_t r, int64_t i) const {
    const int64_t p = prefix(r);
    return i < p ? i : extra_slots[extra_offsets[r] + (i - p)];
  }
};

struct CacheView {
  // float16, as llama.cpp keeps its cache (half the bytes to read per step; sums stay float32)
  uint16_t* keys;    // [layers][kv_heads][capacity / 16][head_dim][16]: tiles of 16 keys, so 16 keys are one load
  uint16_t* values;  // [layers][kv_heads][capacity][head_dim]
  int64_t capacity;
};

struct AttnShape {
  int64_t heads, kv_heads, head_dim;
  float scaling;
  int64_t window = 0;  // > 0: each row sees only the last `window` of its visible keys
  // The first logical key position row r attends to.
  int64_t first(const RowsView& rows, int64_t r) const {
    const int64_t n = rows.visible(r);
    return window > 0 && n > window ? n - window : 0;
  }
};

// One task: the rows `rows_in` (of one cache) that see keys [c·kAttChunk, ...), one key/value head h. Each key
// tile and value row is loaded once for all those rows and the group's query heads. Per (row, query head): the
// chunk's max score m, sum l of exp(score − m), and o = Σ exp(score − m)·v, each lane and sum in a fixed order
// that depends only on that row's keys.
struct Partial {
  float* base;  // [rows][chunks][heads][d + 2]: m, l, o (heads counted from head0)
  int64_t chunks, heads, d;
  int64_t head0 = 0;
  float* at(int64_t r, int64_t c, int64_t head) const {
    return base + ((r * chunks + c) * heads + head - head0) * (d + 2);
  }
};

struct Scratch {
  std::vector<float> scores, acc;
  std::vector<uint16_t> gathered;
  std::vector<const uint16_t*> tiles;
};

// Scores of NG query heads (q rows d apart) against B ≤ 4 key tiles: out[g·kAttChunk + 16·b + lane] =
// scaling · Σ_e q[g][e]·tile_b[e][lane], each lane one chain of fused multiply-adds over e in order. The tiles'
// loads are shared by the heads.
template <int NG, int B>
static inline void scores_block(const float* q, int64_t d, const uint16_t* const* tiles, float scaling, float* out) {
  VF acc[NG][B];
  for (int g = 0; g < NG; ++g)
    for (int b = 0; b < B; ++b) acc[g][b] = vf_zero();
  for (int64_t e = 0; e < d; ++e) {
    VF k[B];
    for (int b = 0; b < B; ++b) k[b] = vf_from_half(tiles[b] + e * kLanes);
    for (int g = 0; g < NG; ++g) {
      const VF qe = vf_set(q[g * d + e]);
      for (int b = 0; b < B; ++b) acc[g][b] = vf_fma(qe, k[b], acc[g][b]);
    }
  }
  const VF scale = vf_set(scaling);
  for (int g = 0; g < NG; ++g)
    for (int b = 0; b < B; ++b) vf_store(out + g * kAttChunk + b * kLanes, vf_mul(acc[g][b], scale));
}

static void scores_tiles(int heads, int blocks, const float* q, int64_t d, const uint16_t* const* tiles,
                         float scaling, float* out) {
#define SD_SCORES(NG)                                                        \
  switch (blocks) {                                                          \
    case 1: return scores_block<NG, 1>(q, d, tiles, scaling, out);           \
    case 2: return scores_block<NG, 2>(q, d, tiles, scaling, out);           \
    case 3: return scores_block<NG, 3>(q, d, tiles, scaling, out);           \
    default: return scores_block<NG, 4>(q, d, tiles, scaling, out);          \
  }
  switch (heads) {
    case 1: SD_SCORES(1)
    case 2: SD_SCORES(2)
    case 3: SD_SCORES(3)
    default: SD_SCORES(4)
  }
#undef SD_SCORES
}

// For NG query heads: acc_g[0 .. 16·V) += Σ_j p_g[j]·rows[j][offset ...], j in order (the value rows' loads
// shared by the heads; acc_g = acc + g·stride, p_g = p + g·kAttChunk).
template <int NG, int V>
static inline void accumulate_values(float* acc, int64_t stride, const float* p, const uint16_t* const* rows,
                                     int64_t n, int64_t offset) {
  VF o[NG][V];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < V; ++v) o[g][v] = vf_load(acc + g * stride + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* row = rows[j] + offset;
    VF x[V];
    for (int v = 0; v < V; ++v) x[v] = vf_from_half(row + v * kLanes);
    for (int g = 0; g < NG; ++g) {
      const VF pj = vf_set(p[g * kAttChunk + j]);
      for (int v = 0; v < V; ++v) o[g][v] = vf_fma(pj, x[v], o[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < V; ++v) vf_store(acc + g * stride + v * kLanes, o[g][v]);
}

// The value accumulation of `heads` query heads over n keys, register-blocked for the usual head sizes.
static void accumulate_heads(int64_t heads, int64_t vectors, float* acc, int64_t stride, const float* p,
                             const uint16_t* const* rows, int64_t n) {
  int64_t g = 0;
  if (vectors == 4) {
    for (; g + 3 <= heads; g += 3) accumulate_values<3, 4>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
    for (; g < heads; ++g) accumulate_values<1, 4>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
  } else if (vectors == 8) {
    for (; g + 2 <= heads; g += 2) accumulate_values<2, 8>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
    for (; g < heads; ++g) accumulate_values<1, 8>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
  } else {
    for (; g < heads; ++g)
      for (int64_t v = 0; v < vectors; v += 4)
        if (v + 4 <= vectors)
          accumulate_values<1, 4>(acc + g * stride + v * kLanes, stride, p + g * kAttChunk, rows, n, v * kLanes);
        else
          for (int64_t u = v; u < vectors; ++u)
            accumulate_values<1, 1>(acc + g * stride + u * kLanes, stride, p + g * kAttChunk, rows, n, u * kLanes);
  }
}

// Ask for [p, p + bytes) into L2 (prefetcht1): the KV cache of a long context streams from DRAM, and without
// these requests its reads did not overlap the arithmetic on AVX-512 (kPrefetchKeys).
static inline void prefetch_to_l2(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at, 0, 2);
}

// Slots [first, first + n) of a cache's keys or values (2·d bytes a slot, contiguous in slot order), clipped to
// its capacity; nothing when `stream` is false. (A function, not a lambda: g++ 12 dropped the prefetches of the
// same code written as a capturing lambda in attend_chunk; check `objdump -d | grep prefetcht1` after changes.)
static inline void prefetch_slots(bool stream, const uint16_t* base, int64_t first, int64_t n, int64_t d,
                                  int64_t capacity) {
  if (!stream) return;
  n = std::min(n, capacity - first);
  if (n > 0) prefetch_to_l2(base + first * d, n * d * 2);
}

static void attend_chunk(const RowsView& rows, const CacheView& cache, int64_t layer, const AttnShape& shape,
                         const float* q, const std::vector<int64_t>& rows_in, const std::vector<int64_t>& out_rows,
                         int64_t h, int64_t c, const Partial& partial, Scratch& scratch) {
  const int64_t d = shape.head_dim, group = shape.heads / shape.kv_heads, tile = d * kLanes;
  const int64_t cap = cache.capacity, nrows = static_cast<int64_t>(rows_in.size());
  const int64_t per_chunk = kAttChunk / kLanes;
  const uint16_t* kbase = cache.keys + (layer * shape.kv_heads + h) * d * cap;
  const uint16_t* vbase = cache.values + (layer * shape.kv_heads + h) * cap * d;
  const int64_t i0 = c * kAttChunk;
  scratch.scores.resize(nrows * group * kAttChunk);
  scratch.tiles.resize(nrows * per_chunk);
  scratch.acc.resize(nrows * group * d);
  int64_t gathers = 0, most = 0;
  std::vector<int64_t> count(nrows), skip(nrows);  // positions i0 .. i0+count; the first `skip` outside the window
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t r = rows_in[i];
    count[i] = std::min(rows.visible(r), i0 + kAttChunk) - i0;
    skip[i] = std::max<int64_t>(0, shape.first(rows, r) - i0);
    most = std::max(most, count[i]);
    const int64_t prefix = rows.prefix(r);
    for (int64_t b = 0; b * kLanes < count[i]; ++b) {
      const int64_t first = i0 + b * kLanes, valid = std::min<int64_t>(kLanes, count[i] - b * kLanes);
      if (first + valid > prefix) ++gathers;
    }
  }
  scratch.gathered.resize(gathers * tile);
  gathers = 0;
  for (int64_t i = 0; i < nrows; ++i) {  // each block of 16 positions: its cache tile, or the row's keys gathered
    const int64_t r = rows_in[i], prefix = rows.prefix(r);
    for (int64_t b = 0; b * kLanes < count[i]; ++b) {
      const int64_t first = i0 + b * kLanes, valid = std::min<int64_t>(kLanes, count[i] - b * kLanes);
      if (first + valid <= prefix) {
        scratch.tiles[i * per_chunk + b] = kbase + (first / kLanes) * tile;  // lanes past `valid`: masked below
        continue;
      }
      uint16_t* dst = scratch.gathered.data() + (gathers++) * tile;
      std::fill(dst, dst + tile, uint16_t{0});
      for (int64_t j = 0; j < valid; ++j) {
        const int64_t slot = rows.slot_of(r, first + j);
        const uint16_t* src = kbase + (slot / kLanes) * tile + slot % kLanes;
        for (int64_t e = 0; e < d; ++e) dst[e * kLanes + j] = src[e * kLanes];
      }
      scratch.tiles[i * per_chunk + b] = dst;
    }
  }
  const int64_t most_blocks = (most + kLanes - 1) / kLanes;
  // The next key tiles and value rows ahead of their use (past this chunk: the next chunk's, which this thread
  // usually takes next). Below ~1,000 cached keys the requests cost more than they save.
  const bool stream = kPrefetchKeys && rows.visible(rows_in.back()) >= kPrefetchKeysFrom;
  prefetch_slots(stream, vbase, i0, 2 * kLanes, d, cap);
  for (int64_t b0 = 0; b0 < most_blocks; b0 += 4) {  // four tiles stay in L1 for every row and query head
    prefetch_slots(stream, kbase, i0 + (b0 + 8) * kLanes, 4 * kLanes, d, cap);  // two blocks of four tiles ahead
    for (int64_t i = 0; i < nrows; ++i) {
      const int64_t blocks = std::min<int64_t>(4, (count[i] + kLanes - 1) / kLanes - b0);
      if (blocks <= 0) continue;
      const uint16_t* const* tp = scratch.tiles.data() + i * per_chunk + b0;
      const float* qrow = q + rows_in[i] * shape.heads * d + h * group * d;
      float* sg = scratch.scores.data() + i * group * kAttChunk + b0 * kLanes;
      for (int64_t g = 0; g < group; g += 4) {
        const int heads = static_cast<int>(std::min<int64_t>(4, group - g));
        scores_tiles(heads, static_cast<int>(blocks), qrow + g * d, d, tp, shape.scaling, sg + g * kAttChunk);
      }
    }
  }
  for (int64_t i = 0; i < nrows; ++i) {  // softmax weights per (row, query head)
    const int64_t n = count[i], lo = skip[i], blocks = (n + kLanes - 1) / kLanes;
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scratch.scores.data() + (i * group + g) * kAttChunk;
      // padding lanes and positions before the window: a valid score for the max, masked to zero below
      for (int64_t j = n; j < blocks * kLanes; ++j) sc[j] = sc[lo];
      for (int64_t j = 0; j < lo; ++j) sc[j] = sc[lo];
      VF mv = vf_load(sc);
      for (int64_t b = 1; b < blocks; ++b) mv = vf_max(mv, vf_load(sc + b * kLanes));
      const float m = vf_hmax(mv);  // a max: exact in any order
      VF l = vf_zero();
      for (int64_t b = 0; b < blocks; ++b) {
        VF p = vf_exp(vf_sub(vf_load(sc + b * kLanes), vf_set(m)));
        if ((b + 1) * kLanes > n || b * kLanes < lo) {
          alignas(64) float mask[kLanes];
          for (int j = 0; j < kLanes; ++j) mask[j] = b * kLanes + j < n && b * kLanes + j >= lo ? 1.0f : 0.0f;
          p = vf_mul(p, vf_load(mask));
        }
        vf_store(sc + b * kLanes, p);
        l = vf_add(l, p);
      }
      float* out = partial.at(out_rows[i], c, h * group + g);
      out[0] = m;
      out[1] = vf_hsum(l);
    }
  }
  const int64_t vectors = d / kLanes;
  std::fill(scratch.acc.begin(), scratch.acc.end(), 0.0f);
  for (int64_t j0 = 0; j0 < most; j0 += kLanes) {  // 16 value rows stay in L1 for every row and query head
    prefetch_slots(stream, vbase, i0 + j0 + 2 * kLanes, kLanes, d, cap);
    for (int64_t i = 0; i < nrows; ++i) {
      const int64_t r = rows_in[i], j1 = std::min(count[i], j0 + kLanes);
      if (j0 >= j1) continue;
      const uint16_t* vrows[kLanes];
      for (int64_t j = j0; j < j1; ++j) vrows[j - j0] = vbase + rows.slot_of(r, i0 + j) * d;
      accumulate_heads(group, vectors, scratch.acc.data() + i * group * d, d,
                       scratch.scores.data() + i * group * kAttChunk + j0, vrows, j1 - j0);
    }
  }
  for (int64_t i = 0; i < nrows; ++i)
    for (int64_t g = 0; g < group; ++g)
      std::memcpy(partial.at(out_rows[i], c, h * group + g) + 2, scratch.acc.data() + (i * group + g) * d,
                  d * sizeof(float));
}

// Row r's chunks: [first_chunk, end_chunk), those holding a key it sees (its window's start on).
static inline int64_t end_chunk(const RowsView& rows, int64_t r) {
  return (rows.visible(r) + kAttChunk - 1) / kAttChunk;
}
static inline int64_t first_chunk(const RowsView& rows, const AttnShape& shape, int64_t r) {
  return shape.first(rows, r) / kAttChunk;
}
static inline bool sees_chunk(const RowsView& rows, const AttnShape& shape, int64_t r, int64_t c) {
  return first_chunk(rows, shape, r) <= c && c < end_chunk(rows, r);
}

// dst[0 .. d) = row r's attention output for one query head: its chunks' partials (partial's row `at`) merged
// in chunk order, o = Σ_c exp(m_c − m)·o_c / Σ_c exp(m_c − m)·l_c with m = max_c m_c (acc: d floats of scratch).
static void merge_chunks(const RowsView& rows, const AttnShape& shape, const Partial& partial, int64_t r,
                         int64_t at, int64_t head, float* acc, float* dst) {
  const int64_t d = shape.head_dim;
  const int64_t mine = end_chunk(rows, r), first = first_chunk(rows, shape, r);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = first; c < mine; ++c) m = std::max(m, partial.at(at, c, head)[0]);
  float l = 0.0f;
  std::fill(acc, acc + d, 0.0f);
  for (int64_t c = first; c < mine; ++c) {
    const float* p = partial.at(at, c, head);
    const float w = exp_scalar(p[0] - m);
    l = l + p[1] * w;
    for (int64_t e = 0; e < d; ++e) acc[e] = acc[e] + p[2 + e] * w;
  }
  for (int64_t e = 0; e < d; ++e) dst[e] = acc[e] / l;
}

// Many rows (a prefill, a large batched pass): one task per (cache, key/value head, block of consecutive rows) walks
// every chunk those rows see with its partials in the task's own scratch, then merges them, so the partials
// never fill a [rows][chunks] array in memory (at 2,048 rows 77 MB a layer, freshly faulted in each call). The
// same attend_chunk and merge_chunks as the per-chunk tasks below: every row's numbers are the same bits.
static void attention_row_blocks(const RowsView& rows, const std::vector<CacheView>& caches, int64_t layer,
                                 const AttnShape& shape, const float* q, float* out, int64_t rows_per_block) {
  const int64_t d = shape.head_dim, group = shape.heads / shape.kv_heads;
  struct Task {
    int64_t cache, h, cost;
    std::vector<int64_t> rows;
  };
  std::vector<Task> tasks;
  for (int64_t ci = 0; ci < static_cast<int64_t>(caches.size()); ++ci) {
    std::vector<int64_t> mine;
    for (int64_t r = 0; r < rows.rows; ++r)
      if (rows.cache(r) == ci) mine.push_back(r);
    for (size_t b = 0; b < mine.size(); b += rows_per_block) {
      std::vector<int64_t> block(mine.begin() + b, mine.begin() + std::min(mine.size(), b + rows_per_block));
      int64_t cost = 0;
      for (int64_t r : block) cost += rows.visible(r) - shape.first(rows, r);
      for (int64_t h = 0; h < shape.kv_heads; ++h) tasks.push_back(Task{ci, h, cost, block});
    }
  }
  // the costliest first, taken one at a time by whichever thread is free: the blocks' costs differ (causal rows)
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    std::vector<float> local, acc(d);
    std::vector<int64_t> seeing, slots;
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      const int64_t n = static_cast<int64_t>(task.rows.size());
      int64_t chunks = 0;
      for (int64_t r : task.rows) chunks = std::max(chunks, end_chunk(rows, r));
      local.resize(n * chunks * group * (d + 2));
      // local index i stands for task.rows[i]: the Partial's rows are 0 .. n-1, its heads this group's
      const Partial partial{local.data(), chunks, group, d, task.h * group};
      for (int64_t c = 0; c < chunks; ++c) {
        seeing.clear();
        slots.clear();
        for (int64_t i = 0; i < n; ++i) {
          const int64_t r = task.rows[i];
          if (!sees_chunk(rows, shape, r, c)) continue;
          seeing.push_back(r);
          slots.push_back(i);
        }
        if (!seeing.empty())
          attend_chunk(rows, caches[task.cache], layer, shape, q, seeing, slots, task.h, c, partial, scratch);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = task.rows[i];
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = task.h * group + g;
          merge_chunks(rows, shape, partial, r, i, head, acc.data(), out + r * shape.heads * d + head * d);
        }
      }
    }
  });
}

// out[r, head·d ...] = softmax(q·K^T · scaling) V over each row's visible keys: the chunks of each row reduced
// as above, then merged in chunk order.
static void attention_rows(const RowsView& rows, const std::vector<CacheView>& caches, int64_t layer,
                           const AttnShape& shape, const float* q, float* out) {
  constexpr int64_t kRowsPerTask = 32, kRowBlocksFrom = 128;  // below 128 rows, chunks balance the threads better
  if (rows.rows >= kRowBlocksFrom) return attention_row_blocks(rows, caches, layer, shape, q, out, kRowsPerTask);
  const int64_t d = shape.head_dim;
  int64_t chunks = 0;
  for (int64_t r = 0; r < rows.rows; ++r) chunks = std::max(chunks, end_chunk(rows, r));
  struct Task {
    int64_t cache, h, c;
    std::vector<int64_t> rows;
  };
  std::vector<Task> tasks;
  for (int64_t ci = 0; ci < static_cast<int64_t>(caches.size()); ++ci) {
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      for (int64_t c = 0; c < chunks; ++c) {
        Task task{ci, h, c, {}};
        for (int64_t r = 0; r < rows.rows; ++r) {
          if (rows.cache(r) != ci || !sees_chunk(rows, shape, r, c)) continue;
          task.rows.push_back(r);
          if (static_cast<int64_t>(task.rows.size()) == kRowsPerTask) {
            tasks.push_back(task);
            task.rows.clear();
          }
        }
        if (!task.rows.empty()) tasks.push_back(std::move(task));
      }
    }
  }
  std::vector<float> partials(rows.rows * chunks * shape.heads * (d + 2));
  const Partial partial{partials.data(), chunks, shape.heads, d};
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      attend_chunk(rows, caches[task.cache], layer, shape, q, task.rows, task.rows, task.h, task.c, partial, scratch);
    }
  });
  at::parallel_for(0, rows.rows * shape.heads, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(d);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / shape.heads, head = i % shape.heads;
      merge_chunks(rows, shape, partial, r, r, head, acc.data(), out + r * shape.heads * d + head * d);
    }
  });
}

static std::vector<CacheView> cache_views(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                          const AttnShape& shape) {
  TORCH_CHECK(keys.size() == values.size() && !keys.empty(), "keys and values: one tensor per cache");
  std::vector<CacheView> views;
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor& k = keys[i];
    const at::Tensor& v = values[i];
    TORCH_CHECK(k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf && k.is_contiguous() &&
                    v.is_contiguous() && k.dim() == 5 && v.dim() == 4,
                "caches: contiguous float16 keys [layers, kv_heads, capacity / 16, head_dim, 16] and values "
                "[layers, kv_heads, capacity, head_dim]");
    TORCH_CHECK(k.size(1) == shape.kv_heads && k.size(3) == shape.head_dim && k.size(4) == kLanes &&
                    v.size(3) == shape.head_dim && v.size(2) == k.size(2) * kLanes && v.size(0) == k.size(0),
                "caches do not match the attention shape");
    views.push_back({reinterpret_cast<uint16_t*>(k.data_ptr<at::Half>()),
                     reinterpret_cast<uint16_t*>(v.data_ptr<at::Half>()), v.size(2)});
  }
  return views;
}

static RowsView rows_view(const at::Tensor& meta, const at::Tensor& extra_offsets, const at::Tensor& extra_slots) {
  TORCH_CHECK(meta.scalar_type() == at::kInt && meta.is_contiguous() && meta.dim() == 2 && meta.size(1) == 4,
              "rows: contiguous int32 [rows, 4]");
  TORCH_CHECK(extra_offsets.scalar_type() == at::kLong && extra_offsets.is_contiguous() &&
                  (extra_offsets.numel() == meta.size(0) + 1 || extra_offsets.numel() == 0) &&
                  extra_slots.scalar_type() == at::kLong && extra_slots.is_contiguous(),
              "extras: int64 offsets [rows + 1] (or none) and slots");
  const bool none = extra_offsets.numel() == 0;
  if (!none)
    TORCH_CHECK(extra_offsets.data_ptr<int64_t>()[0] == 0 &&
                    extra_offsets.data_ptr<int64_t>()[meta.size(0)] == extra_slots.numel(),
                "extras: offsets must span the slots");
  return {meta.data_ptr<int32_t>(), none ? nullptr : extra_offsets.data_ptr<int64_t>(), extra_slots.data_ptr<int64_t>(),
          meta.size(0)};
}

static void check_rows(const RowsView& rows, const std::vector<CacheView>& caches) {
  for (int64_t r = 0; r < rows.rows; ++r) {
    TORCH_CHECK(rows.cache(r) >= 0 && rows.cache(r) < static_cast<int64_t>(caches.size()), "row ", r, ": bad cache");
    const int64_t cap = caches[rows.cache(r)].capacity;
    TORCH_CHECK(rows.slot(r) >= 0 && rows.slot(r) < cap, "row ", r, ": write slot outside the cache");
    TORCH_CHECK(rows.prefix(r) >= 0 && rows.prefix(r) <= cap && rows.visible(r) >= 1, "row ", r, ": bad prefix");
    TORCH_CHECK(rows.extras(r) >= 0, "row ", r, ": bad extras");
    for (int64_t i = 0; i < rows.extras(r); ++i) {
      const int64_t slot = rows.extra_slots[rows.extra_offsets[r] + i];
      TORCH_CHECK(slot >= 0 && slot < cap, "row ", r, ": extra slot outside the cache");
    }
  }
}

// Store rows' keys (transposed) and values at their slots of layer `layer`.
static void store_kv(const RowsView& rows, const std::vector<CacheView>& caches, int64_t layer, const AttnShape& shape,
                     const float* k, const float* v, int64_t ld) {
  const int64_t d = shape.head_dim;
  for (int64_t r = 0; r < rows.rows; ++r) {
    const CacheView& cache = caches[rows.cache(r)];
    const int64_t slot = rows.slot(r);
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      const float* kr = k + r * ld + h * d;
      const float* vr = v + r * ld + h * d;
      uint16_t* kd = cache.keys + ((layer * shape.kv_heads + h) * cache.capacity + (slot / kLanes) * kLanes) * d +
                     slot % kLanes;
      uint16_t* vd = cache.values + ((layer * shape.kv_heads + h) * cache.capacity + slot) * d;
      for (int64_t e = 0; e < d; ++e) {  // rounded to nearest (even), the same on every instruction set
        kd[e * kLanes] = c10::Half(kr[e]).x;
        vd[e] = c10::Half(vr[e]).x;
      }
    }
  }
}

at::Tensor attention(const at::Tensor& q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                     const at::Tensor& meta, const at::Tensor& extra_offsets, const at::Tensor& extra_slots,
                     int64_t layer, int64_t heads, int64_t kv_heads, double scaling, int64_t window) {
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  TORCH_CHECK(qf.dim() == 3 && qf.size(1) == heads && heads % kv_heads == 0, "attention: q must be [rows, heads, d]");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const AttnShape shape{heads, kv_heads, qf.size(2), static_cast<float>(scaling), window};
  TORCH_CHECK(shape.head_dim % kLanes == 0 && shape.head_dim <= 256, "head_dim must be a multiple of 16, <= 256");
  const auto caches = cache_views(keys, values, shape);
  const RowsView rows = rows_view(meta, extra_offsets, extra_slots);
  check_rows(rows, caches);
  TORCH_CHECK(rows.rows == qf.size(0), "attention: one meta row per query row");
  at::Tensor out = at::empty_like(qf);
  attention_rows(rows, caches, layer, shape, qf.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// ------------------------------------------------------------------------------------------------ decoder

// x [rows, hidden] (float32, in place): the decoder layers `layer_ids`, keys/values stored at each row's slot.
// Each cache brings `tables` RoPE tables (cos/sin [capacity, head_dim], cache c's table t at c·tables + t); row
// r's rotary rows are row position(r) of its cache's table for the layer.
void decoder(const at::Tensor& x, at::IntArrayRef layer_ids, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
             std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, int64_t tables, const at::Tensor& meta,
             const at::Tensor& extra_offsets, const at::Tensor& extra_slots, int64_t heads, int64_t kv_heads,
             int64_t head_dim, double eps, double scaling) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 [rows, hidden]");
  const AttnShape shape{heads, kv_heads, head_dim, static_cast<float>(scaling)};
  TORCH_CHECK(head_dim % kLanes == 0 && head_dim <= 256 && heads % kv_heads == 0, "unsupported attention shape");
  const auto caches = cache_views(keys, values, shape);
  const RowsView rows = rows_view(meta, extra_offsets, extra_slots);
  TORCH_CHECK(rows.rows == x.size(0), "one meta row per token");
  check_rows(rows, caches);
  TORCH_CHECK(tables >= 1 && cos.size() == caches.size() * tables && sin.size() == cos.size(),
              "cos/sin: `tables` tables per cache");
  std::vector<const float*> cos_rows(tables * rows.rows), sin_rows(tables * rows.rows);  // [table][row]
  for (size_t i = 0; i < cos.size(); ++i)
    TORCH_CHECK(cos[i].scalar_type() == at::kFloat && sin[i].scalar_type() == at::kFloat && cos[i].is_contiguous() &&
                    sin[i].is_contiguous() && cos[i].dim() == 2 && cos[i].size(1) == head_dim &&
                    sin[i].sizes() == cos[i].sizes(),
                "cos/sin: float32 [capacity, head_dim]");
  for (int64_t t = 0; t < tables; ++t) {
    for (int64_t r = 0; r < rows.rows; ++r) {
      const int64_t c = rows.cache(r) * tables + t, pos = rows.position(r);
      TORCH_CHECK(pos >= 0 && pos < cos[c].size(0), "row ", r, ": position outside the rotary table");
      cos_rows[t * rows.rows + r] = cos[c].data_ptr<float>() + pos * head_dim;
      sin_rows[t * rows.rows + r] = sin[c].data_ptr<float>() + pos * head_dim;
    }
  }
  std::vector<std::shared_ptr<const Layer>> layers;
  for (int64_t id : layer_ids) {
    layers.push_back(layer_at(id));
    const Layer& layer = *layers.back();
    TORCH_CHECK(layer.rope < tables, "layer ", id, " needs RoPE table ", layer.rope, " of ", tables);
    TORCH_CHECK(!layer.q_norm.defined() || (layer.q_norm.numel() == head_dim && layer.k_norm.numel() == head_dim),
                "layer ", id, ": query/key norms must have head_dim values");
  }
  for (const auto& cache : keys) TORCH_CHECK(cache.size(0) >= static_cast<int64_t>(layers.size()), "cache has too few layers");
  const int64_t m = x.size(0), hidden = x.size(1);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  float* xp = x.data_ptr<float>();
  const float e = static_cast<float>(eps);
  std::vector<float> h(m * hidden), q(m * q_width), attn(m * q_width), qkv, gu, act, normed;
  // x += parts(in), or x += norm(parts(in)) when the layer norms that output first (Gemma's sandwich norms);
  // `h` is free scratch at both call sites
  const auto residual_add = [&](const std::vector<std::shared_ptr<const Matrix>>& parts, const float* in,
                                int64_t ld, const at::Tensor& norm) {
    if (!norm.defined()) {
      PhaseTimer timer(kMatrices);
      apply_parts(parts, in, ld, m, xp, hidden, xp, hidden);
      return;
    }
    {
      PhaseTimer timer(kMatrices);
      apply_parts(parts, in, ld, m, h.data(), hidden, nullptr, 0);
    }
    PhaseTimer timer(kNorm);
    normed.resize(m * hidden);
    rms_norm_rows(h.data(), m, hidden, norm.data_ptr<float>(), e, normed.data());
    for (int64_t i = 0; i < m * hidden; i += kLanes)
      vf_store(xp + i, vf_add(vf_load(xp + i), vf_load(normed.data() + i)));
  };
  for (size_t li = 0; li < layers.size(); ++li) {
    const Layer& layer = *layers[li];
    const AttnShape layer_shape{heads, kv_heads, head_dim, static_cast<float>(scaling), layer.window};
    const float* const* layer_cos = cos_rows.data() + layer.rope * rows.rows;
    const float* const* layer_sin = sin_rows.data() + layer.rope * rows.rows;
    const int64_t qkv_width = width_of(layer.qkv), inter = width_of(layer.gate_up) / 2;
    TORCH_CHECK(qkv_width == q_width + 2 * kv_width && layer.qkv[0]->k == hidden, "layer ", li, ": q/k/v shape");
    qkv.resize(m * qkv_width);
    gu.resize(m * 2 * inter);
    act.resize(m * inter);
    {
      PhaseTimer timer(kNorm);
      rms_norm_rows(xp, m, hidden, layer.input_norm.data_ptr<float>(), e, h.data());
    }
    {
      PhaseTimer timer(kMatrices);
      apply_parts(layer.qkv, h.data(), hidden, m, qkv.data(), qkv_width, nullptr, 0);
    }
    if (layer.q_norm.defined()) {
      PhaseTimer timer(kNorm);
      norm_heads(qkv.data(), m, heads, qkv_width, head_dim, layer.q_norm.data_ptr<float>(), e);
      norm_heads(qkv.data() + q_width, m, kv_heads, qkv_width, head_dim, layer.k_norm.data_ptr<float>(), e);
    }
    {
      PhaseTimer timer(kRope);
      rope_rows(qkv.data(), m, heads + kv_heads, qkv_width, head_dim, layer_cos, layer_sin);
      store_kv(rows, caches, static_cast<int64_t>(li), shape, qkv.data() + q_width, qkv.data() + q_width + kv_width,
               qkv_width);
      // attention reads q rows from the fused q/k/v buffer: gather them contiguous first
      for (int64_t r = 0; r < m; ++r)
        std::memcpy(q.data() + r * q_width, qkv.data() + r * qkv_width, q_width * sizeof(float));
    }
    {
      PhaseTimer timer(kAttention);
      attention_rows(rows, caches, static_cast<int64_t>(li), layer_shape, q.data(), attn.data());
    }
    residual_add(layer.o, attn.data(), q_width, layer.attn_out_norm);
    {
      PhaseTimer timer(kNorm);
      rms_norm_rows(xp, m, hidden, layer.post_norm.data_ptr<float>(), e, h.data());
    }
    {
      PhaseTimer timer(kMatrices);
      apply_parts(layer.gate_up, h.data(), hidden, m, gu.data(), 2 * inter, nullptr, 0);
    }
    {
      PhaseTimer timer(kActivation);
      if (layer.gelu)
        gelu_mul_rows(gu.data(), m, inter, act.data());
      else
        silu_mul_rows(gu.data(), m, inter, act.data());
    }
    residual_add(layer.down, act.data(), inter, layer.mlp_out_norm);
  }
}

// ------------------------------------------------------------------------------------------------ LM head

// The `count` highest of v[0..n) by (value descending, index ascending), as a fixed function of v.
static void top_indices(const float* v, int64_t n, int count, int64_t* out) {
  float best[kMaxRefine];
  int64_t index[kMaxRefine];
  int have = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    if (have == count && !(x > best[count - 1])) continue;
    int at = have < count ? have++ : count - 1;
    while (at > 0 && x > best[at - 1]) {
      best[at] = best[at - 1];
      index[at] = index[at - 1];
      --at;
    }
    best[at] = x;
    index[at] = i;
  }
  std::copy(index, index + have, out);
}

// Σ_k w[k]·h[k] in float32 with w = q·scale exact (int8 rows, one scale per block of k / blocks), 16 lanes, fixed tree.
static float exact_dot(const int8_t* q, const float* scale, int64_t k, int64_t block, const float* h) {
  VF acc = vf_zero();
  for (int64_t i = 0; i < k; i += kLanes) {
    const VF w = vf_mul(vf_from_i8(q + i), vf_set(scale[i / block]));
    acc = vf_fma(w, vf_load(h + i), acc);
  }
  return vf_hsum(acc);
}

static inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Output c of tile t's scale of group j, as the kernels compute it (two levels: the exact product d·sc).
static float group_scale(const Matrix& w, int64_t t, int64_t j, int64_t c) {
  const int64_t at = (t * w.groups + j) * kLanes + c;
  switch (w.kind) {
    case kScaleSuper:
      return half_value(w.ssp[(t * w.supers + j / w.per) * kLanes + c]) *
             static_cast<float>(static_cast<const int8_t*>(w.sp)[at]);
    case kScaleF16:
      return half_value(static_cast<const uint16_t*>(w.sp)[at]);
    default:
      return static_cast<const float*>(w.sp)[at];
  }
}

// Output row n of a symmetric matrix read back from its tile layout: q = u − sym (int8) and each group's float32
// scale, so that w = scale·q exactly. The layouts are the ones described at Matrix.
static void matrix_row_int8(const Matrix& w, int64_t n, int8_t* q, float* scale) {
  const bool quads = w.abits == 8 && SD_DOT8;
  const int64_t t = n / kLanes, c = n % kLanes, g = w.g, half = g / 2;
  const int64_t group_bytes = w.nibbles ? g * 8 : g * 16;
  for (int64_t j = 0; j < w.groups; ++j) {
    const uint8_t* p = w.wp + (t * w.groups + j) * group_bytes;
    for (int64_t i = 0; i < g; ++i) {
      int u;
      if (quads && w.nibbles) {
        const uint8_t byte = p[(i / 8) * 64 + 4 * c + i % 4];
        u = i % 8 < 4 ? byte & 15 : byte >> 4;
      } else if (quads) {
        u = p[(i / 4) * 64 + 4 * c + i % 4];
      } else if (w.nibbles) {
        const int64_t e = i < half ? i : i - half;
        const uint8_t byte = p[(e / 2) * 32 + 2 * c + e % 2];
        u = i < half ? byte & 15 : byte >> 4;
      } else {
        u = p[(i / 2) * 32 + 2 * c + i % 2];
      }
      q[j * g + i] = static_cast<int8_t>(u - w.sym);
    }
    scale[j] = group_scale(w, t, j, c);
  }
}

// Rows `rows` of a symmetric matrix as {int8 q [r, k], float32 scales [r, groups]}: its exact weights without a
// second copy of them (a tied head's embedding table and exact rows).
std::vector<at::Tensor> matrix_rows(int64_t matrix, const at::Tensor& rows) {
  const auto w = matrix_at(matrix);
  TORCH_CHECK(w->sym >= 0 && w->sym <= 128, "exact int8 rows need a symmetric matrix");
  const at::Tensor index = rows.to(at::kLong).contiguous();
  const int64_t r = index.numel();
  at::Tensor q = at::empty({r, w->k}, at::kChar), scale = at::empty({r, w->groups}, at::kFloat);
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w->n, "row ", ip[i], " out of range");
    matrix_row_int8(*w, ip[i], q.data_ptr<int8_t>() + i * w->k, scale.data_ptr<float>() + i * w->groups);
  }
  return {q, scale};
}

// logits [rows, vocab] = head(norm(x)); then each row's `refine` highest logits recomputed in float32 from the
// exact int8 rows (int8 [V, hidden] with float32 scales [V, blocks]) when given, else, with `exact_from_head`,
// from the head's own (symmetric) blocks read back from their tiles: the same values, so the same bits.
at::Tensor lm_head(const at::Tensor& x, const at::Tensor& norm, double eps, at::IntArrayRef head, int64_t vocab,
                   const c10::optional<at::Tensor>& exact_q, const c10::optional<at::Tensor>& exact_scale,
                   int64_t refine, bool exact_from_head) {
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wf = norm.to(at::kFloat).contiguous();
  const auto parts = parts_of(head);
  TORCH_CHECK(parts.size() == 1, "the LM head is one matrix");
  const Matrix& w = *parts[0];
  TORCH_CHECK(xf.dim() == 2 && xf.size(1) == w.k && vocab >= 1 && vocab <= w.n, "lm_head: bad shapes");
  TORCH_CHECK(refine >= 0 && refine <= kMaxRefine, "refine must be in 0..", kMaxRefine);
  const int64_t m = xf.size(0), hidden = xf.size(1);
  std::vector<float> h(m * hidden);
  at::Tensor logits = at::empty({m, vocab}, xf.options());
  float* out = logits.data_ptr<float>();
  {
    PhaseTimer timer(kHead);
    rms_norm_rows(xf.data_ptr<float>(), m, hidden, wf.data_ptr<float>(), static_cast<float>(eps), h.data());
    QuantRows q;
    quantize_rows(h.data(), hidden, m, hidden, w.g, w.abits, q);
    linear_rows(w, q, out, vocab, vocab, nullptr, 0);
  }
  if (refine > 0 && !exact_q.has_value() && exact_from_head) {
    PhaseTimer timer(kRefine);
    TORCH_CHECK(w.sym >= 0 && w.sym <= 128, "exact rows from the head: a symmetric head");
    const int count = static_cast<int>(std::min<int64_t>(refine, vocab));
    at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
      int64_t top[kMaxRefine];
      std::vector<int8_t> qrow(hidden);
      std::vector<float> srow(w.groups);
      for (int64_t r = r0; r < r1; ++r) {
        float* row = out + r * vocab;
        top_indices(row, vocab, count, top);
        for (int i = 0; i < count; ++i) {
          matrix_row_int8(w, top[i], qrow.data(), srow.data());
          row[top[i]] = exact_dot(qrow.data(), srow.data(), hidden, w.g, h.data() + r * hidden);
        }
      }
    });
  } else if (refine > 0 && exact_q.has_value()) {
    PhaseTimer timer(kRefine);
    const at::Tensor eq = exact_q->contiguous(), es = exact_scale.value().to(at::kFloat).contiguous();
    TORCH_CHECK(eq.scalar_type() == at::kChar && eq.size(1) == hidden && eq.size(0) >= vocab && es.size(0) == eq.size(0),
                "exact rows: int8 [V, hidden] and float32 scales [V, blocks]");
    const int64_t block = hidden / es.size(1);
    TORCH_CHECK(block * es.size(1) == hidden && block % kLanes == 0, "exact rows: blocks must divide hidden by 16s");
    const int count = static_cast<int>(std::min<int64_t>(refine, vocab));
    const int8_t* qp = eq.data_ptr<int8_t>();
    const float* sp = es.data_ptr<float>();
    at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
      int64_t top[kMaxRefine];
      for (int64_t r = r0; r < r1; ++r) {
        float* row = out + r * vocab;
        top_indices(row, vocab, count, top);
        for (int i = 0; i < count; ++i)
          row[top[i]] = exact_dot(qp + top[i] * hidden, sp + top[i] * es.size(1), hidden, block, h.data() + r * hidden);
      }
    });
  }
  return logits;
}

// ------------------------------------------------------------------------------------------------ EAGLE head

// One step of an EAGLE draft head over rows (feature f_t, embedding e_{t+1}) [n, hidden] each: x = fc(norm(f) ‖
// norm(e)) (unit-scale norms: the head's norm scales are folded into fc's columns), then the head's decoder layer
// (keys/values stored at each row's slot, as `decoder`), then logits = readout(final_norm(x)) of rows
// `read_from`.. . Returns {x [n, hidden] (the predicted features), logits [n - read_from, vocab]}.
std::vector<at::Tensor> head_step(const at::Tensor& features, const at::Tensor& embeddings, int64_t fc, int64_t layer,
                                  const at::Tensor& keys, const at::Tensor& values, const at::Tensor& cos,
                                  const at::Tensor& sin, const at::Tensor& meta, const at::Tensor& extra_offsets,
                                  const at::Tensor& extra_slots, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                  double eps, double scaling, const at::Tensor& norm, double norm_eps, int64_t readout,
                                  int64_t vocab, int64_t read_from) {
  const at::Tensor f = features.to(at::kFloat).contiguous(), e = embeddings.to(at::kFloat).contiguous();
  TORCH_CHECK(f.dim() == 2 && e.sizes() == f.sizes() && f.size(1) % kLanes == 0, "head_step: features and embeddings [n, hidden]");
  const int64_t n = f.size(0), hidden = f.size(1);
  TORCH_CHECK(read_from >= 0 && read_from <= n, "head_step: read_from must be in 0..rows");
  const auto fc_parts = parts_of({fc});
  TORCH_CHECK(fc_parts[0]->k == 2 * hidden && fc_parts[0]->n == hidden, "head_step: fc must map 2·hidden to hidden");
  std::vector<float> ones(hidden, 1.0f), mixed(n * 2 * hidden);
  const float e32 = static_cast<float>(eps);
  {
    PhaseTimer timer(kNorm);
    for (int64_t r = 0; r < n; ++r) {
      rms_norm_rows(f.data_ptr<float>() + r * hidden, 1, hidden, ones.data(), e32, mixed.data() + r * 2 * hidden);
      rms_norm_rows(e.data_ptr<float>() + r * hidden, 1, hidden, ones.data(), e32, mixed.data() + (r * 2 + 1) * hidden);
    }
  }
  at::Tensor x = at::empty({n, hidden}, f.options());
  {
    PhaseTimer timer(kMatrices);
    apply_parts(fc_parts, mixed.data(), 2 * hidden, n, x.data_ptr<float>(), hidden, nullptr, 0);
  }
  const int64_t layer_ids[1] = {layer};
  decoder(x, at::IntArrayRef(layer_ids, 1), {keys}, {values}, {cos}, {sin}, 1, meta, extra_offsets, extra_slots, heads,
          kv_heads, head_dim, eps, scaling);
  const int64_t readout_ids[1] = {readout};
  at::Tensor logits = lm_head(x.narrow(0, read_from, n - read_from), norm, norm_eps,
                              at::IntArrayRef(readout_ids, 1), vocab, c10::nullopt, c10::nullopt, 0, false);
  return {x, logits};
}

// ------------------------------------------------------------------------------------------------ keyed sampling

// Philox4x64-10 (Salmon et al. 2011, Random123) as numpy's ``np.random.Philox(key=(position << 64) | seed)``: block
// b of the stream is philox(counter (b + 1, 0, 0, 0), key (seed, position)) (numpy bumps the counter before each
// block), its 4 words the stream's values 4b .. 4b + 3; ``random()`` maps a word w to (w >> 11) · 2^-53.
static inline void philox4x64(uint64_t block, uint64_t k0, uint64_t k1, uint64_t out[4]) {
  uint64_t c0 = block + 1, c1 = 0, c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += 0x9E3779B97F4A7C15ULL;
      k1 += 0xBB67AE8584CAA73BULL;
    }
    const unsigned __int128 p0 = static_cast<unsigned __int128>(0xD2E7470EE14C6C93ULL) * c0;
    const unsigned __int128 p1 = static_cast<unsigned __int128>(0xCA5A826395121157ULL) * c2;
    c0 = static_cast<uint64_t>(p1 >> 64) ^ c1 ^ k0;
    c1 = static_cast<uint64_t>(p1);
    c2 = static_cast<uint64_t>(p0 >> 64) ^ c3 ^ k1;
    c3 = static_cast<uint64_t>(p0);
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

static inline double philox_uniform(uint64_t word) {
  return static_cast<double>(word >> 11) * (1.0 / 9007199254740992.0);
}

// Standard Gumbel noise -log(-log u), -inf at u = 0, with the C library's log (which Python's math.log calls).
static inline double gumbel_of(double u) {
  return u == 0.0 ? -std::numeric_limits<double>::infinity() : -std::log(-std::log(u));
}

// argmax_x (l_x + g_x) over one row, g_x = gumbel_of(u_x), u = the Philox stream of (seed, position); ties: the
// lowest x. Most x are ruled out without a logarithm: with best0 = l_m + g_m at m = argmax l, x can win only if
// l_x - log E_x >= best0, E_x = -log u_x >= 1 - u_x = f·2^e (f in [1/2, 1)), so only if (e - 1)·ln 2 <= l_x - best0
// (plus a slack for rounding); m and the survivors are compared exactly. keyed_noise.py's numpy path is the same
// function, operation for operation.
static int64_t keyed_gumbel_argmax_row(const double* l, int64_t vocab, uint64_t seed, uint64_t position) {
  constexpr double kLn2 = 0.6931471805599453;
  int64_t m = 0;
  for (int64_t x = 1; x < vocab; ++x)
    if (l[x] > l[m]) m = x;
  uint64_t words[4];
  philox4x64(static_cast<uint64_t>(m / 4), seed, position, words);
  const double best0 = l[m] + gumbel_of(philox_uniform(words[m % 4]));
  const double slack = 1e-9 * (1.0 + std::fabs(best0));
  const int64_t blocks = (vocab + 3) / 4;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / 2048));
  std::vector<double> best(chunks, -std::numeric_limits<double>::infinity());
  std::vector<int64_t> winner(chunks, -1);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      double top = -std::numeric_limits<double>::infinity();
      int64_t at_top = -1;
      uint64_t block_words[4];
      for (int64_t b = blocks * chunk / chunks; b < blocks * (chunk + 1) / chunks; ++b) {
        philox4x64(static_cast<uint64_t>(b), seed, position, block_words);
        for (int64_t lane = 0; lane < 4 && 4 * b + lane < vocab; ++lane) {
          const int64_t x = 4 * b + lane;
          // 1 - u = (2^53 - w)·2^-53 with w = word >> 11, so frexp's exponent e is bit_length(2^53 - w) - 53
          const uint64_t w = block_words[lane] >> 11;
          const int e = 64 - __builtin_clzll((1ULL << 53) - w) - 53;
          if (x != m && !(static_cast<double>(e - 1) * kLn2 <= (l[x] - best0) + slack)) continue;
          const double u = philox_uniform(block_words[lane]);
          const double value = l[x] + gumbel_of(u);
          if (at_top < 0 || value > top) top = value, at_top = x;
        }
      }
      best[chunk] = top, winner[chunk] = at_top;
    }
  });
  int64_t chosen = -1;
  double top = 0.0;
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    if (winner[chunk] >= 0 && (chosen < 0 || best[chunk] > top)) top = best[chunk], chosen = winner[chunk];
  return chosen;
}

// Reproducible sampling's token per row r of ``warped`` [n, V] (float64 warped logits, -inf where warped away):
// argmax_x (warped[r, x] + g(seed, positions[r])_x), the Gumbel-max draw keyed_noise.gumbel_max defines.
at::Tensor keyed_gumbel_argmax(const at::Tensor& warped, int64_t seed, at::IntArrayRef positions) {
  TORCH_CHECK(warped.dim() == 2 && warped.scalar_type() == at::kDouble, "keyed_gumbel_argmax: warped [n, V] float64");
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == warped.size(0), "keyed_gumbel_argmax: one position per row");
  TORCH_CHECK(seed >= 0, "keyed_gumbel_argmax: seed in [0, 2^63)");
  const at::Tensor l = warped.contiguous();
  const int64_t n = l.size(0), vocab = l.size(1);
  TORCH_CHECK(vocab >= 1, "keyed_gumbel_argmax: an empty vocabulary");
  at::Tensor tokens = at::empty({n}, at::kLong);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(positions[r] >= 0, "keyed_gumbel_argmax: positions are >= 0");
    tokens.data_ptr<int64_t>()[r] = keyed_gumbel_argmax_row(l.data_ptr<double>() + r * vocab, vocab,
                                                           static_cast<uint64_t>(seed),
                                                           static_cast<uint64_t>(positions[r]));
  }
  return tokens;
}

// The first ``count`` values of numpy's Philox(key=(position << 64) | seed).random() stream (tests' probe).
at::Tensor philox_uniforms(int64_t seed, int64_t position, int64_t count) {
  at::Tensor u = at::empty({count}, at::kDouble);
  uint64_t words[4];
  for (int64_t x = 0; x < count; ++x) {
    if (x % 4 == 0)
      philox4x64(static_cast<uint64_t>(x / 4), static_cast<uint64_t>(seed), static_cast<uint64_t>(position), words);
    u.data_ptr<double>()[x] = philox_uniform(words[x % 4]);
  }
  return u;
}

// ------------------------------------------------------------------------------------------------ exact sampling

// Inverse-CDF draws for exact sampling (choices.inverse_cdf, verify.speculative_sample). The cumulative sums are
// float64 in a fixed order: the row in blocks of kDrawBlock entries, each block summed in 8 lanes (lane l takes
// entries l, l + 8, ...; combined as ((0+1)+(2+3))+((4+5)+(6+7)), then the block's tail in order); P_b, the mass
// before block b, is the running sum of the block sums in order, and inside block b, C(j) = P_b + w_start + ... + w_j
// in order. The draw at u is the first j with C(j) > u·P_B (P_B the total); a zero-weight entry never qualifies
// (adding 0 leaves C unchanged). Where rounding leaves block b's last C(j) at or below u·P_B although
// P_{b+1} > u·P_B, or u·P_B reaches P_B, the draw is the last entry with weight there: off by at most float64
// rounding, as any cumulative sum is.
constexpr int64_t kDrawBlock = 64;
constexpr double kResidualEps = 1e-12;  // verify.RESIDUAL_EPS

enum class Weight { kP, kResidual, kWithout };  // p; max(0, p - q); p with one entry zeroed

template <Weight W, typename T>
static inline double draw_weight(const T* p, const float* q, int64_t removed, int64_t j) {
  if constexpr (W == Weight::kP) {
    return static_cast<double>(p[j]);
  } else if constexpr (W == Weight::kResidual) {
    const double d = static_cast<double>(p[j]) - static_cast<double>(q[j]);
    return d < 0.0 ? 0.0 : d;  // NaN stays NaN, as torch's clamp_min keeps it
  } else {
    return j == removed ? 0.0 : static_cast<double>(p[j]);
  }
}

template <Weight W, typename T>
static double block_sum(const T* p, const float* q, int64_t removed, int64_t start, int64_t end) {
  double lane[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  int64_t j = start;
  for (; j + 8 <= end; j += 8)
    for (int l = 0; l < 8; ++l) lane[l] += draw_weight<W>(p, q, removed, j + l);
  double s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; j < end; ++j) s += draw_weight<W>(p, q, removed, j);
  return s;
}

// The total mass of the weights and their block sums (into ``sums``).
template <Weight W, typename T>
static double draw_mass(const T* p, const float* q, int64_t removed, int64_t vocab, std::vector<double>& sums) {
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_sum<W>(p, q, removed, b * kDrawBlock, std::min(vocab, (b + 1) * kDrawBlock));
    total += sums[b];
  }
  return total;
}

// The draw at uniform u given ``draw_mass``'s total and block sums; -1 when the mass is not positive and finite.
template <Weight W, typename T>
static int64_t draw_from(const T* p, const float* q, int64_t removed, int64_t vocab, const std::vector<double>& sums,
                         double total, double u) {
  if (!(std::isfinite(total) && total > 0.0)) return -1;
  const double goal = u * total;
  double before = 0.0;  // P_b
  int64_t last_block = -1;
  for (int64_t b = 0; b < static_cast<int64_t>(sums.size()); ++b) {
    if (sums[b] > 0.0) last_block = b;
    const double after = before + sums[b];
    if (after > goal) {
      const int64_t start = b * kDrawBlock, end = std::min(vocab, start + kDrawBlock);
      double c = before;
      int64_t last = -1;
      for (int64_t j = start; j < end; ++j) {
        const double w = draw_weight<W>(p, q, removed, j);
        c += w;
        if (c > goal) return j;
        if (w > 0.0) last = j;
      }
      return last;
    }
    before = after;
  }
  const int64_t start = last_block * kDrawBlock, end = std::min(vocab, start + kDrawBlock);
  for (int64_t j = end - 1; j >= start; --j)
    if (draw_weight<W>(p, q, removed, j) > 0.0) return j;
  return -1;
}

template <typename T>
static int64_t draw_row(const T* p, int64_t vocab, double u, std::vector<double>& sums) {
  const double total = draw_mass<Weight::kP>(p, static_cast<const float*>(nullptr), -1, vocab, sums);
  return draw_from<Weight::kP>(p, static_cast<const float*>(nullptr), -1, vocab, sums, total, u);
}

// choices.inverse_cdf: per row r of ``probs`` [n, V] (float32 or float64, non-negative), the draw at u[r]; -1 for a
// row with no positive, finite mass.
at::Tensor inverse_cdf_rows(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && (probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble),
              "inverse_cdf_rows: probs [n, V] float32 or float64");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == probs.size(0),
              "inverse_cdf_rows: one float64 uniform per row");
  const at::Tensor rows = probs.contiguous();
  const at::Tensor uc = u.contiguous();
  const int64_t n = rows.size(0), vocab = rows.size(1);
  at::Tensor drawn = at::empty({n}, at::kLong);
  std::vector<double> sums;
  for (int64_t r = 0; r < n; ++r) {
    const double ur = uc.data_ptr<double>()[r];
    drawn.data_ptr<int64_t>()[r] = rows.scalar_type() == at::kFloat
                                       ? draw_row(rows.data_ptr<float>() + r * vocab, vocab, ur, sums)
                                       : draw_row(rows.data_ptr<double>() + r * vocab, vocab, ur, sums);
  }
  return drawn;
}

// torch.argmax(logits, dim=-1) for float32 rows [n, V], the same index: the first maximal value's, a row's first NaN
// if it has one (torch orders NaN above every number). One vector pass for the maximum (NaN noted apart), one for
// the first index that holds it: ~6 us a row of 49,152 with AVX-512, ~8 with AVX2, against torch's ~100 us.
static float row_max(const float* row, int64_t vocab, bool* nan) {
  int64_t j = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
#if defined(SD_AVX512)
  const int64_t whole = vocab - vocab % 64;
  __m512 m0 = _mm512_set1_ps(best), m1 = m0, m2 = m0, m3 = m0;
  __mmask16 unordered = 0;
  for (; j < whole; j += 64) {
    const __m512 a = _mm512_loadu_ps(row + j), b = _mm512_loadu_ps(row + j + 16);
    const __m512 c = _mm512_loadu_ps(row + j + 32), d = _mm512_loadu_ps(row + j + 48);
    unordered |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(a, m0);  // max_ps(x, m) keeps m where x is NaN
    m1 = _mm512_max_ps(b, m1);
    m2 = _mm512_max_ps(c, m2);
    m3 = _mm512_max_ps(d, m3);
  }
  best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  any_nan = unordered != 0;
#elif defined(SD_AVX2)
  const int64_t whole = vocab - vocab % 32;
  __m256 m0 = _mm256_set1_ps(best), m1 = m0, m2 = m0, m3 = m0;
  __m256 unordered = _mm256_setzero_ps();
  for (; j < whole; j += 32) {
    const __m256 a = _mm256_loadu_ps(row + j), b = _mm256_loadu_ps(row + j + 8);
    const __m256 c = _mm256_loadu_ps(row + j + 16), d = _mm256_loadu_ps(row + j + 24);
    unordered = _mm256_or_ps(unordered,
                             _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    m0 = _mm256_max_ps(a, m0);
    m1 = _mm256_max_ps(b, m1);
    m2 = _mm256_max_ps(c, m2);
    m3 = _mm256_max_ps(d, m3);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  for (const float x : lanes) best = best < x ? x : best;
  any_nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; j < vocab; ++j) {
    any_nan |= std::isnan(row[j]);
    best = best < row[j] ? row[j] : best;
  }
  *nan = any_nan;
  return best;
}

// the first j with row[j] == best (with ``nan``: the first NaN); a row of -inf finds its first entry
static int64_t first_index(const float* row, int64_t vocab, float best, bool nan) {
  int64_t j = 0;
#if defined(SD_AVX512)
  const int64_t whole = vocab - vocab % 16;
  const __m512 target = _mm512_set1_ps(best);
  for (; j < whole; j += 16) {
    const __m512 x = _mm512_loadu_ps(row + j);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(x, target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#elif defined(SD_AVX2)
  const int64_t whole = vocab - vocab % 8;
  const __m256 target = _mm256_set1_ps(best);
  for (; j < whole; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(x, x, _CMP_UNORD_Q) : _mm256_cmp_ps(x, target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < vocab; ++j) {
    if (nan ? std::isnan(row[j]) : row[j] == best) return j;
  }
  return 0;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits [n, V] float32, V > 0");
  const at::Tensor rows = logits.contiguous();
  const int64_t n = rows.size(0), vocab = rows.size(1);
  at::Tensor chosen = at::empty({n}, at::kLong);
  const float* data = rows.data_ptr<float>();
  int64_t* out = chosen.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      bool nan = false;
      const float best = row_max(data + r * vocab, vocab, &nan);
      out[r] = first_index(data + r * vocab, vocab, best, nan);
    }
  });
  return chosen;
}

// verify.speculative_sample for a chain, in one call: guess i (token x_i) is accepted iff accept_u[i] < p_i(x_i) /
// q_i(x_i) in float64 (0 where q_i(x_i) = 0; q_i(x_i) = 1 without ``draft``, point masses); after a rejection at n
// the next token is drawn at draw_u from max(0, p_n - q_n) (p_n with x_n zeroed for a point mass; p_n itself when
// that mass is <= kResidualEps or not finite), after k acceptances from p_k. ``target`` [k+1, V] and ``draft``
// [k, V] float32. Returns {n_accepted, token}, token -1 when the row drawn from has no positive, finite mass.
std::vector<int64_t> exact_chain(const at::Tensor& target, const c10::optional<at::Tensor>& draft,
                                 const at::Tensor& tokens, const at::Tensor& accept_u, double draw_u) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "exact_chain: tokens [k] int64");
  const int64_t k = tokens.size(0);
  TORCH_CHECK(target.dim() == 2 && target.scalar_type() == at::kFloat && target.size(0) == k + 1,
              "exact_chain: target [k+1, V] float32");
  TORCH_CHECK(accept_u.dim() == 1 && accept_u.scalar_type() == at::kDouble && accept_u.size(0) == k,
              "exact_chain: accept_u [k] float64");
  const int64_t vocab = target.size(1);
  const at::Tensor p = target.contiguous();
  at::Tensor q;
  if (draft.has_value()) {
    TORCH_CHECK(draft->dim() == 2 && draft->scalar_type() == at::kFloat && draft->size(0) == k &&
                    draft->size(1) == vocab,
                "exact_chain: draft [k, V] float32");
    q = draft->contiguous();
  }
  const at::Tensor x = tokens.contiguous();
  const at::Tensor ua = accept_u.contiguous();
  const float* pp = p.data_ptr<float>();
  const float* qp = q.defined() ? q.data_ptr<float>() : nullptr;
  int64_t n = k;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t token = x.data_ptr<int64_t>()[i];
    TORCH_CHECK(token >= 0 && token < vocab, "exact_chain: a drafted token outside the vocabulary");
    const double px = pp[i * vocab + token];
    const double qx = qp ? static_cast<double>(qp[i * vocab + token]) : 1.0;
    const double ratio = qx > 0.0 ? px / std::max(qx, std::numeric_limits<double>::min()) : 0.0;
    if (!(ua.data_ptr<double>()[i] < ratio)) {
      n = i;
      break;
    }
  }
  const float* row = pp + n * vocab;
  std::vector<double> sums;
  if (n < k) {
    const int64_t rejected = x.data_ptr<int64_t>()[n];
    if (qp) {
      const float* qrow = qp + n * vocab;
      const double mass = draw_mass<Weight::kResidual>(row, qrow, -1, vocab, sums);
      if (mass > kResidualEps) return {n, draw_from<Weight::kResidual>(row, qrow, -1, vocab, sums, mass, draw_u)};
    } else {
      const double mass = draw_mass<Weight::kWithout>(row, qp, rejected, vocab, sums);
      if (mass > kResidualEps)
        return {n, draw_from<Weight::kWithout>(row, qp, rejected, vocab, sums, mass, draw_u)};
    }
  }
  return {n, draw_row(row, vocab, draw_u, sums)};
}

// ------------------------------------------------------------------------------------------------ tests' probes

std::vector<at::Tensor> quantize(const at::Tensor& x, int64_t g) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  TORCH_CHECK(xf.dim() == 2 && (g == 16 || g == 32) && xf.size(1) % g == 0, "quantize: x [rows, k], g 16 or 32");
  QuantRows q;
  quantize_rows(xf.data_ptr<float>(), xf.size(1), xf.size(0), xf.size(1), g, 16, q);
  auto qt = at::from_blob(q.q.data(), {xf.size(0), xf.size(1)}, at::kShort).clone();
  auto dt = at::from_blob(q.d.data(), {xf.size(0), q.groups}, at::kFloat).clone();
  return {qt, dt};
}

at::Tensor exp_lanes(const at::Tensor& x) {
  at::Tensor xf = x.to(at::kFloat).contiguous().view(-1);
  TORCH_CHECK(xf.numel() % kLanes == 0, "exp_lanes: a multiple of 16 values");
  at::Tensor y = at::empty_like(xf);
  for (int64_t i = 0; i < xf.numel(); i += kLanes) vf_store(y.data_ptr<float>() + i, vf_exp(vf_load(xf.data_ptr<float>() + i)));
  return y.view(x.sizes());
}

// Whether matrices with int8 activations take the quad layout (vpdpbusd builds) rather than the pairs one.
bool quad_layout() { return SD_DOT8; }

std::string isa() {
#if SD_AVX512
#ifdef __AVX512VNNI__
  return "avx512-vnni";
#else
  return "avx512";
#endif
#elif SD_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace sd

TORCH_LIBRARY(SD_NS, m) {
  m.def("register_matrix(Tensor packed, Tensor scales, Tensor? offsets, Tensor? bias, int n, int k, int g, bool nibbles, int sym, int abits, Tensor? supers=None, Tensor? super_offsets=None, int per=1) -> int",
        &sd::register_matrix);
  m.def("register_layer(Tensor input_norm, int[] qkv, int[] o, Tensor post_norm, int[] gate_up, int[] down, Tensor? q_norm, Tensor? k_norm, Tensor? attn_out_norm, Tensor? mlp_out_norm, int window, int rope, bool gelu) -> int",
        &sd::register_layer);
  m.def("release(int matrix, int layer) -> ()", &sd::release);
  m.def("matrix_rows(int matrix, Tensor rows) -> Tensor[]", &sd::matrix_rows);
  m.def("repack_rows(Tensor raw, str kind, int row0, int k, bool quads, Tensor(a!) packed, Tensor(b!) scales, Tensor(c!)? offsets, Tensor(d!)? supers, Tensor(e!)? super_offsets) -> ()", &sd::repack_rows);
  m.def("linear(Tensor x, int[] parts) -> Tensor", &sd::linear);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &sd::rms_norm);
  m.def("attention(Tensor q, Tensor[] keys, Tensor[] values, Tensor meta, Tensor extra_offsets, Tensor extra_slots, int layer, int heads, int kv_heads, float scaling, int window=0) -> Tensor",
        &sd::attention);
  m.def("decoder(Tensor x, int[] layers, Tensor[] keys, Tensor[] values, Tensor[] cos, Tensor[] sin, int tables, Tensor meta, Tensor extra_offsets, Tensor extra_slots, int heads, int kv_heads, int head_dim, float eps, float scaling) -> ()",
        &sd::decoder);
  m.def("lm_head(Tensor x, Tensor norm, float eps, int[] head, int vocab, Tensor? exact_q, Tensor? exact_scale, int refine, bool exact_from_head=False) -> Tensor",
        &sd::lm_head);
  m.def("head_step(Tensor features, Tensor embeddings, int fc, int layer, Tensor keys, Tensor values, Tensor cos, Tensor sin, Tensor meta, Tensor extra_offsets, Tensor extra_slots, int heads, int kv_heads, int head_dim, float eps, float scaling, Tensor norm, float norm_eps, int readout, int vocab, int read_from) -> Tensor[]",
        &sd::head_step);
  m.def("quantize(Tensor x, int g) -> Tensor[]", &sd::quantize);
  m.def("exp_lanes(Tensor x) -> Tensor", &sd::exp_lanes);
  m.def("keyed_gumbel_argmax(Tensor warped, int seed, int[] positions) -> Tensor", &sd::keyed_gumbel_argmax);
  m.def("philox_uniforms(int seed, int position, int count) -> Tensor", &sd::philox_uniforms);
  m.def("inverse_cdf_rows(Tensor probs, Tensor u) -> Tensor", &sd::inverse_cdf_rows);
  m.def("argmax_rows(Tensor logits) -> Tensor", &sd::argmax_rows);
  m.def("exact_chain(Tensor target, Tensor? draft, Tensor tokens, Tensor accept_u, float draw_u) -> int[]", &sd::exact_chain);
  m.def("isa() -> str", &sd::isa);
  m.def("quad_layout() -> bool", &sd::quad_layout);
  m.def("profile(bool enable) -> float[]", &sd::profile);
}
