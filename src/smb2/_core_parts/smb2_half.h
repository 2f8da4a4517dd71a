/* smb2._core's half-width floats <-> float32 (kernels.pxi says how they round). */
#ifndef SMB2_HALF_H
#define SMB2_HALF_H

#include <stdint.h>
#include <string.h>
static inline uint16_t smb2_f32_to_bf16(uint32_t x) {
    if ((x & 0x7fffffffu) > 0x7f800000u)          /* NaN: quiet it */
        return (uint16_t)((x >> 16) | 0x0040u);
    /* + 0x7fff rounds half down, + 0x8000 half up: the lowest kept bit
       picks, which is ties to even; a carry moves into the exponent,
       up to inf, as it must */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
static inline uint32_t smb2_bf16_to_f32(uint16_t h) { return (uint32_t)h << 16; }

/* float16 branch-free (masks, not branches: the loops vectorize), after
   F. Giesen's float_to_half_fast3_rtne and half_to_float; checked equal
   to a plain branchy version on all 2**32 float32 inputs.  The FPU does
   the subnormal rounding (round to nearest even, the default mode; with
   denormals-are-zero set, float32 subnormal inputs still give 0, right). */
static inline uint16_t smb2_f32_to_f16(uint32_t x) {
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu, aligned;
    float f;
    /* below 2**-14 the result is subnormal: adding 0.5 leaves the value
       in units of 2**-24 (rounded) in the low mantissa bits */
    memcpy(&f, &a, 4);
    f += 0.5f;
    memcpy(&aligned, &f, 4);
    uint32_t subnormal = aligned - 0x3f000000u;
    /* normal: rebias 127 -> 15 and round 23 -> 10 bits; a carry moves
       into the exponent, and at 65520 or more on to inf */
    uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
    uint32_t is_nan = -(uint32_t)(a > 0x7f800000u);
    uint32_t special = 0x7c00u | (is_nan & (0x0200u | ((a >> 13) & 0x3ffu)));  /* inf, quiet NaN */
    uint32_t big = -(uint32_t)(a >= 0x47800000u), small = -(uint32_t)(a < 0x38800000u);
    return (uint16_t)(sign | (big & special) | (~big & ((small & subnormal) | (~small & normal))));
}
static inline uint32_t smb2_f16_to_f32(uint16_t h) {
    uint32_t exp = ((uint32_t)h << 13) & 0x0f800000u;
    uint32_t o = (((uint32_t)h & 0x7fffu) << 13) + 0x38000000u;     /* rebias 15 -> 127 */
    /* a subnormal m * 2**-24 is (2**-14 + m * 2**-24) - 2**-14, exactly */
    uint32_t sub = o + 0x00800000u;
    float f;
    memcpy(&f, &sub, 4);
    f -= 6.103515625e-05f;
    memcpy(&sub, &f, 4);
    uint32_t infnan = -(uint32_t)(exp == 0x0f800000u), zero = -(uint32_t)(exp == 0);
    o = (infnan & (o + 0x38000000u)) | (zero & sub) | (~(infnan | zero) & o);
    return o | ((uint32_t)(h & 0x8000u) << 16);
}

#endif /* SMB2_HALF_H */
