/* What this CPU runs *and* the OS has enabled, for choosing which builds of the kernels may be
 * loaded (tandem/kernels/cpu_isa.py). Compiled for plain x86-64 (no -march), so it runs on any
 * x86-64 CPU before any vector build is touched.
 *
 * An instruction set is usable when CPUID advertises it and the OS saves its registers on a
 * context switch: XCR0 (read with XGETBV, present when CPUID.1:ECX.OSXSAVE) bits 1-2 for the
 * 256-bit YMM state of AVX/AVX2, bits 5-7 for AVX-512's opmask and ZMM state. AMX also needs the
 * process's permission for its tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA). */
#include <cpuid.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

enum {
    TQ_AVX2 = 1 << 0,       /* AVX2 + FMA + F16C, YMM state enabled */
    TQ_AVXVNNI = 1 << 1,    /* AVX-VNNI (VEX VPDPBUSD), YMM state enabled */
    TQ_AVX512 = 1 << 2,     /* AVX-512 F + BW + VL + DQ + CD + VNNI, ZMM state enabled */
    TQ_AVX512BF16 = 1 << 3, /* AVX512_BF16 on top of TQ_AVX512 */
    TQ_AVX512VBMI = 1 << 4, /* AVX512_VBMI on top of TQ_AVX512 */
    TQ_AMX = 1 << 5,        /* AMX tile + int8: CPUID, XCR0 bits 17-18 and the permission */
};

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

int tandem_cpu_features(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave) return 0;
    const uint64_t x = xcr0();
    const int ymm = (x & 0x6) == 0x6, zmm = (x & 0xe6) == 0xe6, tiles = (x & 0x60000) == 0x60000;
    unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
    if (__get_cpuid_count(7, 0, &a, &b7, &c7, &d7) && a >= 1) {
        unsigned bb, cc, dd;
        __get_cpuid_count(7, 1, &a71, &bb, &cc, &dd);
    }
    int f = 0;
    if (ymm && ((b7 >> 5) & 1) && fma && f16c) f |= TQ_AVX2;
    if ((f & TQ_AVX2) && ((a71 >> 4) & 1)) f |= TQ_AVXVNNI;
    const unsigned need512 = 1u << 16 | 1u << 17 | 1u << 28 | 1u << 30 | 1u << 31; /* F DQ CD BW VL */
    if ((f & TQ_AVX2) && zmm && (b7 & need512) == need512 && ((c7 >> 11) & 1)) f |= TQ_AVX512;
    if ((f & TQ_AVX512) && ((a71 >> 5) & 1)) f |= TQ_AVX512BF16;
    if ((f & TQ_AVX512) && ((c7 >> 1) & 1)) f |= TQ_AVX512VBMI;
    /* AMX-TILE (EDX 24) and AMX-INT8 (EDX 25), tile state in XCR0, and Linux's permission */
    if (tiles && ((d7 >> 24) & 1) && ((d7 >> 25) & 1) &&
        syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0)
        f |= TQ_AMX;
    return f;
}
