/* Q8_0 rows to tandem's repacked form GT_Q8_0X (quant.h: scales first, then per group of 16
 * blocks 8 vectors whose 32-bit lane i is block i's next 4 quants, as w + 128) and back, in place
 * or into another buffer. A row keeps its 34 nb bytes, so a weight repacked in place needs no
 * second copy and row slices (parts, shards) stay whole rows. Every byte is moved, none is
 * recomputed: unpack(pack(W)) == W bit for bit, and the kernels' integer dots and scales are the
 * same numbers in the same canon.h order (qgemv.c, qgemm.c, qgemm256.c take either type). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

/* One row: Q8_0 (src) -> Q8_0X (dst), or back (unpack), src and dst distinct. */
static void q8x_row(const uint8_t *src, uint8_t *dst, int64_t nb, int unpack) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *s = unpack ? src + 2 * b : src + 34 * b;
        uint8_t *d = unpack ? dst + 34 * b : dst + 2 * b;
        d[0] = s[0], d[1] = s[1];
        for (int64_t j = 0; j < 32; j += 4) {
            const int64_t at = tq_q8x_at(nb, b, j);
            for (int e = 0; e < 4; e++) {
                if (unpack)
                    d[2 + j + e] = src[at + e] ^ 0x80;
                else
                    dst[at + e] = s[2 + j + e] ^ 0x80;
            }
        }
    }
}

static int q8x_rows(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t K, int nthreads,
                    int unpack) {
    if (!src || !dst || rows < 0 || K < 32 || K % 32) return -1;
    const int64_t nb = K / 32, rb = 34 * nb;
    int bad = 0;
#pragma omp parallel num_threads(nthreads < 1 ? 1 : nthreads) reduction(| : bad)
    {
        uint8_t *tmp = (uint8_t *)malloc((size_t)rb); /* a row, so src may be dst */
        if (!tmp) bad = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!tmp) continue;
            memcpy(tmp, src + r * rb, (size_t)rb);
            q8x_row(tmp, dst + r * rb, nb, unpack);
        }
        free(tmp);
    }
    return bad ? -1 : 0;
}

/* `rows` Q8_0 rows of K columns at src into GT_Q8_0X at dst (dst == src: in place). 0, or -1 for
 * bad arguments or no memory. */
int tandem_q8x_pack(const void *src, void *dst, int64_t rows, int64_t K, int nthreads) {
    return q8x_rows((const uint8_t *)src, (uint8_t *)dst, rows, K, nthreads, 0);
}

/* The inverse: GT_Q8_0X rows back to Q8_0 as the file stores them. */
int tandem_q8x_unpack(const void *src, void *dst, int64_t rows, int64_t K, int nthreads) {
    return q8x_rows((const uint8_t *)src, (uint8_t *)dst, rows, K, nthreads, 1);
}
