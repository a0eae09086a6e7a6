/* Column blocks of one source's rows, each to its own destination, in one pass.
 *
 * nereus_copy_row_blocks(src, rows, src_stride, k, dst, dst_stride, offset, width):
 * for every row r < rows and block j < k, copies width[j] bytes from
 * src + r*src_stride + offset[j] to dst[j] + r*dst_stride[j].
 *
 * Why: a row-parallel weight cut into column blocks for several peers is a strided box
 * per peer. Copying the boxes one after the other reads every source row once per box,
 * and the hardware fetches the whole row each time (half the rate of a contiguous
 * copy). Here each source row is read once, while it is in the cache, and the blocks
 * are written with non-temporal stores where the destination row is 16-byte aligned
 * (no read of destination lines that are about to be overwritten).
 *
 * Loaded with ctypes (nereus/transfer/_copy.py); it touches no Python object and
 * holds no lock: the caller keeps every buffer alive and in bounds. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static void copy_block(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    if (((uintptr_t)d & 15) == 0) {
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        if (i < n) memcpy(d + i, s + i, n - i);
        return;
    }
#endif
    memcpy(d, s, n);
}

void nereus_copy_row_blocks(const char *src, size_t rows, size_t src_stride, size_t k,
                            char *const *dst, const size_t *dst_stride,
                            const size_t *offset, const size_t *width) {
    for (size_t r = 0; r < rows; r++) {
        const char *row = src + r * src_stride;
        for (size_t j = 0; j < k; j++)
            copy_block(dst[j] + r * dst_stride[j], row + offset[j], width[j]);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the caller reports done */
#endif
}
