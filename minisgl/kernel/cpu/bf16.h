// bf16 <-> float32 for the C kernels, rounding as torch does.
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// round to nearest even, as torch converts float32 to bf16; a NaN stays a (quiet) NaN
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
