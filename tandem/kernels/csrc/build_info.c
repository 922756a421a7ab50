/* What this build of the kernels was compiled to use, in csrc/cpu_probe.c's bits: the tests
 * check each ISA variant's library against the variant's table row (tandem/kernels/cpu_isa.py),
 * so a flag that did not reach the compiler shows. */
int tandem_build_features(void) {
    int f = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    f |= 1 << 0;
#endif
#if defined(__AVXVNNI__)
    f |= 1 << 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512CD__) && defined(__AVX512VNNI__)
    f |= 1 << 2;
#endif
#if defined(__AVX512BF16__)
    f |= 1 << 3;
#endif
#if defined(__AVX512VBMI__)
    f |= 1 << 4;
#endif
#if defined(__AMX_TILE__)
    f |= 1 << 5;
#endif
    return f;
}
