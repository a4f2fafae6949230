/* Host check of the weight decoders of kernels/wo_decode.cuh (the same source
 * the CUDA kernels compile; its primitives are plain C++ here). For every
 * format and both 16-bit targets it compares, bit for bit, against the C
 * reference (cq_float_decode, the int8 cast):
 *   - every code at every position of a GEMV unit, through the k-tile pairing
 *     the GEMV uses (and that the tiles cover each code exactly once);
 *   - every code at every position of a row-decoder octet;
 *   - the NaN and inf/NaN marks of fp8 words and the x-pair picking;
 *   - the power of two that makes every value of a format exact in f16 (wo_f16_shift).
 * Built and run by tests/test_wo_decode.py; prints "ok" and exits 0, or prints
 * the first mismatches and exits 1. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "wo_decode.cuh"

namespace {

struct Format {
  char name[32];
  int kind, bits, ebits, mbits, bias, specials;
};

int failures = 0;

void fail(const char *what) {
  if (failures++ < 20) fprintf(stderr, "%s\n", what);
}

float ref_value(const Format &f, uint32_t code) {
  if (f.kind == kWoInt8) return (float)(int8_t)(uint8_t)code;
  return cq_float_decode(code, f.ebits, f.mbits, f.bias, f.specials);
}

bool fits_f16(const Format &f) {
  for (uint32_t c = 0; c < (1u << f.bits); ++c) {
    const float v = ref_value(f, c);
    if (v == v && cq_f16_to_f32(cq_f32_to_f16(v)) != v) return false;
  }
  return true;
}

/* wo_f16_shift: found exactly when the format's range fits f16's after a power of two
 * (2^E + M <= 41: largest exponent plus mantissa bits within f16's 40 binades), 0 when it fits
 * as it is, and every value times 2^shift is an f16 (and back, exactly). */
void check_f16_shift(const Format &f) {
  int shift = 99;
  const bool found = wo_f16_shift(f.kind == kWoInt8, f.bits, f.ebits, f.mbits, f.bias,
                                  f.specials, &shift);
  const bool expect = f.kind == kWoInt8 || (1 << f.ebits) + f.mbits <= 41;
  char msg[200];
  if (found != expect || (found && (shift == 0) != fits_f16(f))) {
    snprintf(msg, sizeof msg, "%s: f16 shift found %d (shift %d), expected %d", f.name, found, shift, expect);
    fail(msg);
    return;
  }
  if (!found) return;
  for (uint32_t c = 0; c < (1u << f.bits); ++c) {
    const float v = ref_value(f, c);
    if (v != v) continue;
    const float t = v * cq_exp2i(shift);
    if (cq_f16_to_f32(cq_f32_to_f16(t)) != t || t * cq_exp2i(-shift) != v) {
      snprintf(msg, sizeof msg, "%s: code 0x%x (%g) times 2^%d is not exact in f16", f.name, c, (double)v, shift);
      fail(msg);
    }
  }
}

bool is_e4m3_nan(const Format &f, uint32_t code) { return f.kind == kWoE4M3 && (code & 0x7fu) == 0x7fu; }

/* One decoded 16-bit half against the reference value of its code. */
void check_half(const Format &f, bool bf16, uint32_t code, uint32_t half, const char *where, int pos) {
  if (is_e4m3_nan(f, code)) return; /* junk by design: the row is marked instead */
  const float v = ref_value(f, code);
  char msg[200];
  if (v != v) {
    const bool nan = bf16 ? (half & 0x7fffu) > 0x7f80u : (half & 0x7fffu) > 0x7c00u;
    if (!nan) {
      snprintf(msg, sizeof msg, "%s %s %s pos %d code 0x%x: expected NaN, got 0x%04x", f.name, bf16 ? "bf16" : "f16",
               where, pos, code, half);
      fail(msg);
    }
    return;
  }
  const uint32_t want = bf16 ? cq_f32_to_bf16(v) : cq_f32_to_f16(v);
  if (half != want) {
    snprintf(msg, sizeof msg, "%s %s %s pos %d code 0x%x (%g): expected 0x%04x, got 0x%04x", f.name,
             bf16 ? "bf16" : "f16", where, pos, code, (double)v, want, half);
    fail(msg);
  }
}

template <int NW>
void pack(const uint32_t *codes, int n, int bits, uint32_t (&w)[NW]) {
  for (int i = 0; i < NW; ++i) w[i] = 0;
  for (int j = 0; j < n; ++j) {
    const int bit = j * bits;
    w[bit / 32] |= codes[j] << (bit % 32);
    if (bit % 32 + bits > 32) w[bit / 32 + 1] |= codes[j] >> (32 - bit % 32);
  }
}

uint64_t rng_state = 0x9e3779b97f4a7c15ull;
uint32_t rnd() {
  rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 16);
}

/* Codes of trial t: a shifted ramp for t < 2^bits (every code at every
 * position), random codes after that (varied neighbours). */
void trial_codes(int t, int n, int bits, uint32_t *codes) {
  const uint32_t mask = (1u << bits) - 1u;
  for (int j = 0; j < n; ++j) codes[j] = t < (1 << bits) ? (uint32_t)(5 * j + t) & mask : rnd() & mask;
}

template <int KIND, int BITS, bool BF16>
void check_unit(const Format &f) {
  typedef WoCodec<KIND, BITS> C;
  typedef WoUnit<BITS> U;
  constexpr int P = C::kPair;
  const typename C::Consts cc(f.ebits, f.bias, BF16);
  int cover[U::kCodes] = {0};
  for (int v = 0; v < U::kCodes / 4; ++v) {
    const int k0 = WoTile<P>::k0(v), k2 = WoTile<P>::k2(v);
    ++cover[k0], ++cover[k0 + P], ++cover[k2], ++cover[k2 + P];
  }
  for (int j = 0; j < U::kCodes; ++j)
    if (cover[j] != 1) {
      char msg[120];
      snprintf(msg, sizeof msg, "%s: k-tiles cover code %d of a unit %d times", f.name, j, cover[j]);
      fail(msg);
    }
  for (int t = 0; t < (1 << BITS) + 2000; ++t) {
    uint32_t codes[U::kCodes], w[U::kWords];
    trial_codes(t, U::kCodes, BITS, codes);
    pack(codes, U::kCodes, BITS, w);
    for (int v = 0; v < U::kCodes / 4; ++v) {
      const int ks[2] = {WoTile<P>::k0(v), WoTile<P>::k2(v)};
      for (int i = 0; i < 2; ++i) {
        const uint32_t h = C::template pair<BF16>(w, ks[i], ks[i] + P, cc);
        check_half(f, BF16, codes[ks[i]], h & 0xffffu, "unit", ks[i]);
        check_half(f, BF16, codes[ks[i] + P], h >> 16, "unit", ks[i] + P);
      }
    }
  }
}

template <int KIND, int BITS>
void check_octet(const Format &f) {
  typedef WoCodec<KIND, BITS> C;
  const typename C::Consts cc(f.ebits, f.bias, true);
  for (int t = 0; t < (1 << BITS) + 2000; ++t) {
    uint32_t codes[8], w[2];
    trial_codes(t, 8, BITS, codes);
    pack(codes, 8, BITS, w);
    for (int b = 8 * BITS; b < 64; ++b) w[b / 32] |= (rnd() & 1u) << (b % 32); /* junk past the octet */
    float v[8];
    C::values8(w, cc, v);
    for (int j = 0; j < 8; ++j) {
      if (is_e4m3_nan(f, codes[j])) continue;
      const float want = ref_value(f, codes[j]);
      const bool same = want != want ? v[j] != v[j] : (cq_f32_bits(v[j]) == cq_f32_bits(want));
      if (!same) {
        char msg[160];
        snprintf(msg, sizeof msg, "%s octet pos %d code 0x%x: expected %g, got %g", f.name, j, codes[j], (double)want,
                 (double)v[j]);
        fail(msg);
      }
    }
  }
}

template <int KIND, int BITS>
void check_format(const Format &f) {
  check_unit<KIND, BITS, true>(f);
  if (fits_f16(f)) check_unit<KIND, BITS, false>(f);
  check_octet<KIND, BITS>(f);
}

void check_marks() {
  for (int t = 0; t < 200000; ++t) {
    uint32_t word = rnd() ^ (rnd() << 16);
    if (t % 3 == 0) word |= 0x7fu << (8 * (t % 4)); /* plant specials */
    uint32_t nan = 0, special = 0;
    for (int b = 0; b < 4; ++b) {
      const uint32_t byte = (word >> (8 * b)) & 0xffu;
      if ((byte & 0x7fu) == 0x7fu) nan |= 0x80u << (8 * b);
      if ((byte & 0x7cu) == 0x7cu) special |= 0x80u << (8 * b);
    }
    if ((wo_e4m3_nan_marks(word) & 0x80808080u) != nan) fail("e4m3 NaN marks differ from the bytes");
    if ((wo_e5m2_special_marks(word) & 0x80808080u) != special) fail("e5m2 special marks differ from the bytes");
  }
}

void check_pick() {
  uint32_t x[8];
  for (int i = 0; i < 8; ++i) x[i] = (uint32_t)(2 * i) | ((uint32_t)(2 * i + 1) << 16);
  for (int a = 0; a < 16; ++a)
    for (int b = 0; b < 16; ++b) {
      const uint32_t r = wo_pick2(x, a, b);
      if (r != ((uint32_t)a | ((uint32_t)b << 16))) fail("wo_pick2 picks the wrong halves");
    }
}

}  // namespace

int main() {
  int formats = 0;
  {
    Format f = {"int8", kWoInt8, 8, 0, 7, 0, 0};
    check_format<kWoInt8, 8>(f), check_f16_shift(f), ++formats;
    Format e4 = {"fp8_e4m3", kWoE4M3, 8, 4, 3, 7, 1};
    check_format<kWoE4M3, 8>(e4), check_f16_shift(e4), ++formats;
    Format e5 = {"fp8_e5m2", kWoE5M2, 8, 5, 2, 15, 2};
    check_format<kWoE5M2, 8>(e5), check_f16_shift(e5), ++formats;
  }
  for (int e = 1; e <= 6; ++e)
    for (int m = 0; 1 + e + m <= 7; ++m) {
      const int bits = 1 + e + m;
      if (bits < 3) continue;
      Format f;
      snprintf(f.name, sizeof f.name, "fp%d_e%dm%d", bits, e, m);
      f.kind = kWoFpX, f.bits = bits, f.ebits = e, f.mbits = m, f.bias = (1 << (e - 1)) - 1, f.specials = 0;
      switch (bits) {
        case 3: check_format<kWoFpX, 3>(f); break;
        case 4: check_format<kWoFpX, 4>(f); break;
        case 5: check_format<kWoFpX, 5>(f); break;
        case 6: check_format<kWoFpX, 6>(f); break;
        default: check_format<kWoFpX, 7>(f); break;
      }
      check_f16_shift(f);
      ++formats;
    }
  check_marks();
  check_pick();
  if (failures) {
    fprintf(stderr, "%d mismatches\n", failures);
    return 1;
  }
  printf("ok: %d formats\n", formats);
  return 0;
}
