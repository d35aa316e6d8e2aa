// The weight registry: matrices in the kernels' tile layout, registered from Python's packed tensors
// (register_matrix) or decoded straight from a GGUF file's blocks (repack_rows), and decoder layers made of
// them (register_layer), each held by id until released.
//
// A part of the kernels' one translation unit: ops.cpp includes the parts in order.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "simd.h"

namespace sd {

// ------------------------------------------------------------------------------------------------ weights

// One matrix [n outputs, k inputs] in tiles of 16 outputs; per tile, group after group of g inputs, packed in one of
// three ways (Packing: bytes, nibbles, nibbles + high bits), each in one of two layouts. Pairs (int16 activations;
// int8 ones where vpdpbusd is missing):
//   nibbles: g/4 chunks of 32 bytes; byte 2c+j of chunk q holds u[c][2q+j] (low) and u[c][2(q+g/4)+j] (high);
//   bytes:   g/2 chunks of 32 bytes; byte 2c+j of chunk p holds u[c][2p+j].
// Quads (int8 activations on vpdpbusd builds, see quad_layout):
//   nibbles: g/8 chunks of 64 bytes; byte 4c+j of chunk b holds u[c][8b+j] (low) and u[c][8b+4+j] (high);
//   bytes:   g/4 chunks of 64 bytes; byte 4c+j of chunk q holds u[c][4q+j].
// Nibbles + high bits (5-bit types, g = 32: 5/8 of a byte per weight): the nibbles layout of u & 15 (g·8 bytes),
// then the group's plane of fifth bits (g·2 bytes): per nibble chunk of C bytes (C = 32 pairs, 64 quads), 2·C bits,
// little-endian: bit l the fifth bit of byte l's low nibble, bit C + l of its high nibble (plane_bit).
// scales and offsets (asymmetric types only), [tile][group][16], in one of three kinds (ScaleKind): f32; f16; or
// a K-quant's two levels, int8 multipliers per group times f16 factors per super-block of `per` groups (supers and
// super_offsets: [tile][super][16]): s = d·sc, both exact in float32, so bitwise the f32 kind's product.
enum Packing : int { kPackBytes = 0, kPackNibbles = 1, kPackNibblesHighBits = 2 };

// Bytes of one group of one tile (16 outputs × g inputs) packed as `packing`.
constexpr int64_t packed_group_bytes(int packing, int64_t g) {
  return packing == kPackBytes ? g * 16 : packing == kPackNibbles ? g * 8 : g * 10;
}

// Where input i (of a group of g) of output c of a tile sits in its group's bytes: the byte, and the shift of its
// nibble (0: low, 4: high; bytes: 0).
struct Slot {
  int64_t byte;
  int shift;
};

static inline Slot slot_of(int packing, bool quads, int64_t g, int64_t c, int64_t i) {
  if (packing == kPackBytes) return quads ? Slot{(i / 4) * 64 + 4 * c + i % 4, 0} : Slot{(i / 2) * 32 + 2 * c + i % 2, 0};
  if (quads) return {(i / 8) * 64 + 4 * c + i % 4, i % 8 < 4 ? 0 : 4};
  const int64_t half = g / 2, e = i < half ? i : i - half;
  return {(e / 2) * 32 + 2 * c + e % 2, i < half ? 0 : 4};
}

// The bit of a group's high-bit plane (which follows its g·8 nibble bytes) that holds the fifth bit of the nibble
// at `s`.
static inline int64_t plane_bit(Slot s, bool quads) {
  const int64_t chunk = quads ? 64 : 32;
  return (s.byte / chunk) * 2 * chunk + (s.shift != 0 ? chunk : 0) + s.byte % chunk;
}

// u (< 2^bits of the packing) written into / read from a group's zeroed bytes `group` at input i of output c.
static inline void put_value(uint8_t* group, int packing, bool quads, int64_t g, int64_t c, int64_t i, uint8_t u) {
  const Slot s = slot_of(packing, quads, g, c, i);
  if (packing == kPackBytes) {
    group[s.byte] = u;
    return;
  }
  group[s.byte] |= static_cast<uint8_t>((u & 15) << s.shift);
  if (packing == kPackNibblesHighBits && (u & 16) != 0) {
    const int64_t bit = plane_bit(s, quads);
    group[g * 8 + bit / 8] |= static_cast<uint8_t>(1 << (bit % 8));
  }
}

static inline int get_value(const uint8_t* group, int packing, bool quads, int64_t g, int64_t c, int64_t i) {
  const Slot s = slot_of(packing, quads, g, c, i);
  if (packing == kPackBytes) return group[s.byte];
  int u = (group[s.byte] >> s.shift) & 15;
  if (packing == kPackNibblesHighBits) {
    const int64_t bit = plane_bit(s, quads);
    u |= ((group[g * 8 + bit / 8] >> (bit % 8)) & 1) << 4;
  }
  return u;
}

enum ScaleKind : int { kScaleF32 = 0, kScaleF16 = 1, kScaleSuper = 2 };

struct Matrix {
  int64_t n = 0, k = 0, g = 0, tiles = 0, groups = 0;
  int64_t per = 1, supers = 0;  // kScaleSuper: groups per super-block, super-blocks per tile row
  int packing = kPackBytes;  // a Packing
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
  int64_t group_bytes() const { return packed_group_bytes(packing, g); }
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
                        const c10::optional<at::Tensor>& super_offsets, int64_t per, bool high_bits) {
  TORCH_CHECK(g == 16 || g == 32, "group size must be 16 or 32");
  TORCH_CHECK(!high_bits || (nibbles && g == 32), "high bits come on nibbles in groups of 32");
  TORCH_CHECK(abits == 8 || abits == 16, "activation bits must be 8 or 16");
  TORCH_CHECK(k % g == 0 && n > 0, "bad matrix shape");
  auto m = std::make_shared<Matrix>();
  m->n = n;
  m->k = k;
  m->g = g;
  m->tiles = (n + kLanes - 1) / kLanes;
  m->groups = k / g;
  m->packing = high_bits ? kPackNibblesHighBits : nibbles ? kPackNibbles : kPackBytes;
  m->sym = static_cast<int32_t>(sym);
  m->abits = abits;
  m->packed = packed.contiguous();
  TORCH_CHECK(m->packed.scalar_type() == at::kByte, "packed weights must be uint8");
  TORCH_CHECK(m->packed.numel() == m->tiles * m->groups * m->group_bytes(), "packed weights have the wrong size");
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
  int bits;                 // of u
  bool offsets;
};

static BlockFormat block_format(const std::string& kind) {
  if (kind == "Q4_0") return {32, 18, 32, 1, 4, false};
  if (kind == "Q4_1") return {32, 20, 32, 1, 4, true};
  if (kind == "Q5_0") return {32, 22, 32, 1, 5, false};
  if (kind == "Q5_1") return {32, 24, 32, 1, 5, true};
  if (kind == "Q8_0") return {32, 34, 32, 1, 8, false};
  if (kind == "Q4_K") return {256, 144, 32, 8, 4, true};
  if (kind == "Q5_K") return {256, 176, 32, 8, 5, true};
  if (kind == "Q6_K") return {256, 210, 16, 16, 6, false};
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
// given (packed zeroed; scales/offsets f16, or int8 with f16 supers/super_offsets for K-quants): 4-bit types as
// nibbles, 5-bit ones as nibbles + high bits if `high_bits` (else bytes), wider ones as bytes. Threads split whole
// tiles: outputs of one tile share bytes of the high-bit plane.
void repack_rows(const at::Tensor& raw, const std::string& kind, int64_t row0, int64_t k, bool quads,
                 const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                 const c10::optional<at::Tensor>& supers, const c10::optional<at::Tensor>& super_offsets,
                 bool high_bits) {
  const BlockFormat f = block_format(kind);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "raw blocks: uint8 [rows, bytes]");
  TORCH_CHECK(k % f.elements == 0 && raw.size(1) == k / f.elements * f.bytes, "raw blocks: the wrong row size");
  TORCH_CHECK(f.offsets == offsets.has_value() && (f.per > 1) == supers.has_value(), "repack: the type's fields");
  TORCH_CHECK(!high_bits || f.bits == 5, "high bits: 5-bit types only");
  const int packing = f.bits <= 4 ? kPackNibbles : high_bits ? kPackNibblesHighBits : kPackBytes;
  const int64_t rows = raw.size(0), g = f.g, groups = k / g, blocks = k / f.elements, gpb = f.elements / g;
  const int64_t group_bytes = packed_group_bytes(packing, g), n_supers = f.per > 1 ? groups / f.per : 0;
  TORCH_CHECK(packed.numel() >= (row0 + rows + kLanes - 1) / kLanes * groups * group_bytes, "repack: packed too small");
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  void* sp = scales.data_ptr();
  void* op = offsets.has_value() ? offsets->data_ptr() : nullptr;
  uint16_t* ssp = supers.has_value() ? reinterpret_cast<uint16_t*>(supers->data_ptr()) : nullptr;
  uint16_t* sop = super_offsets.has_value() ? reinterpret_cast<uint16_t*>(super_offsets->data_ptr()) : nullptr;
  if (rows == 0) return;
  const int64_t first_tile = row0 / kLanes, end_tile = (row0 + rows - 1) / kLanes + 1;
  at::parallel_for(first_tile, end_tile, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> u(f.elements);
    int8_t sc[16], mn[16];
    uint16_t hs = 0, hm = 0, sd = 0, sm = 0;
    const int64_t r0 = std::max<int64_t>(t0 * kLanes - row0, 0), r1 = std::min<int64_t>(t1 * kLanes - row0, rows);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = row0 + r, t = n / kLanes, c = n % kLanes;
      for (int64_t bi = 0; bi < blocks; ++bi) {
        decode_block(kind, rp + r * raw.size(1) + bi * f.bytes, u.data(), &hs, &hm, sc, mn, sd, sm);
        for (int64_t gj = 0; gj < gpb; ++gj) {
          const int64_t j = bi * gpb + gj, at = (t * groups + j) * kLanes + c;
          uint8_t* base = pp + (t * groups + j) * group_bytes;
          const uint8_t* v = u.data() + gj * g;
          for (int64_t i = 0; i < g; ++i) put_value(base, packing, quads, g, c, i, v[i]);
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

}  // namespace sd
