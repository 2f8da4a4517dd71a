/* smb2._core's copies past the cache, for large copies on a mapping (mapped_stripes.pxi). */
#ifndef SMB2_STREAM_H
#define SMB2_STREAM_H

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
/* memcpy with non-temporal stores: the destination bypasses the cache */
static inline void smb2_stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        /* a segment is in 4 KiB pages, where the hardware prefetcher
           stops: ask for the line 1 KiB ahead (it never faults) */
        _mm_prefetch((const char *)src + 1024, _MM_HINT_NTA);
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
/* streamed stores are weakly ordered: visible before anything later */
static inline void smb2_stream_fence(void) { _mm_sfence(); }
#else
static inline void smb2_stream_copy(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }
static inline void smb2_stream_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

#endif /* SMB2_STREAM_H */
