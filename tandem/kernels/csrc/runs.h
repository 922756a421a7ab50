/* How the GEMV and dense prefill drivers hand W's row chunks to threads (qgemv.c, dense_drive.h).
 *
 * Runs: thread t owns the contiguous chunks [chunks * t / T, chunks * (t + 1) / T) and takes
 * them front to back, so the chunk it takes next is known (the one after) and can be read ahead;
 * a thread done early takes the other runs' last chunks, back to front, so a descheduled thread
 * does not stall the call. Each run's front and back share one word, so the owner and a thread
 * done early claim each chunk exactly once.
 *
 * Ahead: while a chunk computes, the next one's rows are prefetched to L2 a few cache lines at a
 * time (`ahead_some`, called by the tiles between steps), so a chunk's first pass over W does
 * not wait on memory at every cache line of rows the hardware prefetcher has not yet seen. */
#ifndef TANDEM_RUNS_H
#define TANDEM_RUNS_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* one thread's run: the next chunk from the front (low 32 bits), one past the last (high) */
typedef struct {
    uint64_t fb;
    char pad[56];
} qrun;

/* T runs over `chunks` chunks, or NULL without memory */
static inline qrun *runs_new(int64_t chunks, int T) {
    qrun *runs = (qrun *)aligned_alloc(64, (size_t)T * sizeof(qrun));
    if (runs)
        for (int t = 0; t < T; t++)
            runs[t].fb = (uint64_t)(chunks * t / T) | (uint64_t)(chunks * (t + 1) / T) << 32;
    return runs;
}

/* The front chunk of run r (own) or its back one; -1 when it is empty. */
static inline int64_t claim(qrun *r, int own) {
    uint64_t v = __atomic_load_n(&r->fb, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
        if (f >= b) return -1;
        const uint64_t nv = own ? v + 1 : (uint64_t)(b - 1) << 32 | f;
        if (__atomic_compare_exchange_n(&r->fb, &v, nv, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return own ? (int64_t)f : (int64_t)b - 1;
    }
}

/* the bytes still to prefetch, `per` cache lines at each `ahead_some` */
typedef struct {
    const char *next, *end;
    int64_t per;
} ahead_t;

static inline ahead_t ahead_of(const void *w, int64_t nbytes, int64_t steps) {
    const int64_t lines = (nbytes + 63) / 64;
    return (ahead_t){(const char *)w, (const char *)w + nbytes,
                     steps > 0 ? (lines + steps - 1) / steps : lines};
}

static inline void ahead_some(ahead_t *a) {
    for (int64_t q = 0; q < a->per && a->next < a->end; q++, a->next += 64)
        _mm_prefetch(a->next, _MM_HINT_T1);
}

#endif
