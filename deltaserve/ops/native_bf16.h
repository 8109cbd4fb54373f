/* bf16 <-> fp32 for the CPU's C kernels (the native.c of each op family): `native_backend.py` builds them with this
 * directory on the include path and keys their cache on this file too. bf16 is the top half of an fp32: widening is
 * exact. */
#ifndef DELTASERVE_NATIVE_BF16_H
#define DELTASERVE_NATIVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's cast; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
