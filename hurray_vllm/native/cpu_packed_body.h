/* One instantiation of the kernels in cpu_packed.c for element type T, name suffix SUF and AMX pair width P. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* vec / vec16 keys: plane [D][N] (the key stored transposed). */
void CAT(hurray_vec_keys_, SUF)(const T *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb,
                                int64_t sh, int64_t H, int64_t N, int64_t D, T *dst) {
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            const T *src = base + blocks[i] * sb + h * sh;
            T *out = dst + (i * N * H + h) * D;
            /* 16 tokens at a time: their 16 destination rows stay in L1 while every dim is visited. */
            for (int64_t n0 = 0; n0 < N; n0 += 16) {
                int64_t n1 = n0 + 16 < N ? n0 + 16 : N;
                for (int64_t d = 0; d < D; d++) {
                    const T *col = src + d * N;
                    for (int64_t n = n0; n < n1; n++) out[n * H * D + d] = col[n];
                }
            }
        }
    }
}

/* amx keys: plane [N/16][D/P][16 tokens][P dims]. */
void CAT(hurray_amx_keys_, SUF)(const T *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb,
                                int64_t sh, int64_t H, int64_t N, int64_t D, T *dst) {
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            const T *tile = base + blocks[i] * sb + h * sh;
            T *out = dst + (i * N * H + h) * D;
            for (int64_t nh = 0; nh < N / 16; nh++) {
                for (int64_t dp = 0; dp < D / P; dp++, tile += 16 * P) {
                    for (int64_t nl = 0; nl < 16; nl++) {
                        T *row = out + (nh * 16 + nl) * H * D + dp * P;
                        for (int64_t p = 0; p < P; p++) row[p] = tile[nl * P + p];
                    }
                }
            }
        }
    }
}

/* amx values: plane [D/16][N/P][16 dims][P tokens]. Token-major loop: whole destination rows at a time. */
void CAT(hurray_amx_values_, SUF)(const T *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb,
                                  int64_t sh, int64_t H, int64_t N, int64_t D, T *dst) {
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            const T *plane = base + blocks[i] * sb + h * sh;
            T *out = dst + (i * N * H + h) * D;
            for (int64_t nh = 0; nh < N / P; nh++) {
                for (int64_t dh = 0; dh < D / 16; dh++) {
                    const T *tile = plane + (dh * (N / P) + nh) * 16 * P;
                    for (int64_t p = 0; p < P; p++) {
                        T *row = out + (nh * P + p) * H * D + dh * 16;
                        for (int64_t dl = 0; dl < 16; dl++) row[dl] = tile[dl * P + p];
                    }
                }
            }
        }
    }
}

/* The inverses, into the cache: same arguments, `dst` read as the interchange source. */

/* vec / vec16 keys into plane [D][N]. */
void CAT(hurray_vec_keys_put_, SUF)(T *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                                    int64_t H, int64_t N, int64_t D, const T *src) {
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            T *plane = base + blocks[i] * sb + h * sh;
            const T *in = src + (i * N * H + h) * D;
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                int64_t d1 = d0 + 16 < D ? d0 + 16 : D;
                for (int64_t n = 0; n < N; n++) {
                    const T *row = in + n * H * D;
                    for (int64_t d = d0; d < d1; d++) plane[d * N + n] = row[d];
                }
            }
        }
    }
}

/* vec / vec16 values into plane [N][D] (row-major: whole rows). */
void CAT(hurray_rows_put_, SUF)(T *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                                int64_t H, int64_t N, int64_t D, const T *src) {
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            T *plane = base + blocks[i] * sb + h * sh;
            const T *in = src + (i * N * H + h) * D;
            for (int64_t n = 0; n < N; n++)
                for (int64_t d = 0; d < D; d++) plane[n * D + d] = in[n * H * D + d];
        }
    }
}

/* amx keys into plane [N/16][D/P][16 tokens][P dims]. */
void CAT(hurray_amx_keys_put_, SUF)(T *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                                    int64_t H, int64_t N, int64_t D, const T *src) {
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            T *tile = base + blocks[i] * sb + h * sh;
            const T *in = src + (i * N * H + h) * D;
            for (int64_t nh = 0; nh < N / 16; nh++) {
                for (int64_t dp = 0; dp < D / P; dp++, tile += 16 * P) {
                    for (int64_t nl = 0; nl < 16; nl++) {
                        const T *row = in + (nh * 16 + nl) * H * D + dp * P;
                        for (int64_t p = 0; p < P; p++) tile[nl * P + p] = row[p];
                    }
                }
            }
        }
    }
}

/* amx values into plane [D/16][N/P][16 dims][P tokens]. */
void CAT(hurray_amx_values_put_, SUF)(T *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb,
                                      int64_t sh, int64_t H, int64_t N, int64_t D, const T *src) {
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            T *plane = base + blocks[i] * sb + h * sh;
            const T *in = src + (i * N * H + h) * D;
            for (int64_t nh = 0; nh < N / P; nh++) {
                for (int64_t dh = 0; dh < D / 16; dh++) {
                    T *tile = plane + (dh * (N / P) + nh) * 16 * P;
                    for (int64_t p = 0; p < P; p++) {
                        const T *row = in + (nh * P + p) * H * D + dh * 16;
                        for (int64_t dl = 0; dl < 16; dl++) tile[dl * P + p] = row[dl];
                    }
                }
            }
        }
    }
}

#undef CAT
#undef CAT_
