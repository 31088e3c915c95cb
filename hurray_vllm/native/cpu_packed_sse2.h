/* 16-bit (bfloat16, float16) kernels of cpu_packed.c with SSE2 shuffles: the same results as the
 * portable loops, 2-3x faster. Signatures and layouts as in cpu_packed_body.h, with P = 2. */
#include <emmintrin.h>
#include <string.h>

#define LD(p) _mm_loadu_si128((const __m128i *)(p))
#define ST(p, x) _mm_storeu_si128((__m128i *)(p), (x))

/* An 8x8 block of 16-bit elements: row k of the input (at s + k * ss) becomes column k of the
 * output (rows at o + k * os). Both directions of the vec keys use it. */
static inline void tr8x8_16(const uint16_t *s, int64_t ss, uint16_t *o, int64_t os) {
    __m128i a0 = LD(s), a1 = LD(s + ss), a2 = LD(s + 2 * ss), a3 = LD(s + 3 * ss);
    __m128i a4 = LD(s + 4 * ss), a5 = LD(s + 5 * ss), a6 = LD(s + 6 * ss), a7 = LD(s + 7 * ss);
    __m128i t0 = _mm_unpacklo_epi16(a0, a1), t1 = _mm_unpackhi_epi16(a0, a1);
    __m128i t2 = _mm_unpacklo_epi16(a2, a3), t3 = _mm_unpackhi_epi16(a2, a3);
    __m128i t4 = _mm_unpacklo_epi16(a4, a5), t5 = _mm_unpackhi_epi16(a4, a5);
    __m128i t6 = _mm_unpacklo_epi16(a6, a7), t7 = _mm_unpackhi_epi16(a6, a7);
    __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
    __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
    __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
    __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
    ST(o, _mm_unpacklo_epi64(u0, u4));
    ST(o + os, _mm_unpackhi_epi64(u0, u4));
    ST(o + 2 * os, _mm_unpacklo_epi64(u1, u5));
    ST(o + 3 * os, _mm_unpackhi_epi64(u1, u5));
    ST(o + 4 * os, _mm_unpacklo_epi64(u2, u6));
    ST(o + 5 * os, _mm_unpackhi_epi64(u2, u6));
    ST(o + 6 * os, _mm_unpacklo_epi64(u3, u7));
    ST(o + 7 * os, _mm_unpackhi_epi64(u3, u7));
}

/* A 4x4 block of 32-bit words (an AMX key's dim pairs), likewise: both directions of the AMX keys. */
static inline void tr4x4_32(const uint32_t *s, int64_t ss, uint32_t *o, int64_t os) {
    __m128i v0 = LD(s), v1 = LD(s + ss), v2 = LD(s + 2 * ss), v3 = LD(s + 3 * ss);
    __m128i t0 = _mm_unpacklo_epi32(v0, v1), t1 = _mm_unpackhi_epi32(v0, v1);
    __m128i t2 = _mm_unpacklo_epi32(v2, v3), t3 = _mm_unpackhi_epi32(v2, v3);
    ST(o, _mm_unpacklo_epi64(t0, t2));
    ST(o + os, _mm_unpackhi_epi64(t0, t2));
    ST(o + 2 * os, _mm_unpacklo_epi64(t1, t3));
    ST(o + 3 * os, _mm_unpackhi_epi64(t1, t3));
}

/* vec / vec16 keys, plane [D][N]: 8x8 transposes of 16-bit elements. */
void hurray_vec_keys_2(const uint16_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                       int64_t H, int64_t N, int64_t D, uint16_t *dst) {
    if (N % 8 || D % 8) {
        hurray_vec_keys_2_generic(base, blocks, i0, i1, sb, sh, H, N, D, dst);
        return;
    }
    const int64_t r = H * D;
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            const uint16_t *plane = base + blocks[i] * sb + h * sh;
            uint16_t *out = dst + (i * N * H + h) * D;
            for (int64_t n0 = 0; n0 < N; n0 += 8) {
                for (int64_t d0 = 0; d0 < D; d0 += 8) {
                    tr8x8_16(plane + d0 * N + n0, N, out + n0 * r + d0, r);
                }
            }
        }
    }
}

/* amx keys, plane [N/16][D/2][16 tokens][2 dims]: a dim pair is one 32-bit word; 4x4 word transposes. */
void hurray_amx_keys_2(const uint16_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                       int64_t H, int64_t N, int64_t D, uint16_t *dst) {
    if (D % 8) {
        hurray_amx_keys_2_generic(base, blocks, i0, i1, sb, sh, H, N, D, dst);
        return;
    }
    const int64_t r = H * D;
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            const uint32_t *plane = (const uint32_t *)(base + blocks[i] * sb + h * sh);
            uint16_t *out = dst + (i * N * H + h) * D;
            for (int64_t nh = 0; nh < N / 16; nh++) {
                const uint32_t *blk = plane + nh * (D / 2) * 16;
                for (int64_t nl = 0; nl < 16; nl += 4) {
                    uint16_t *row = out + (nh * 16 + nl) * r;
                    for (int64_t dp = 0; dp < D / 2; dp += 4) {
                        tr4x4_32(blk + dp * 16 + nl, 16, (uint32_t *)(row + 2 * dp), r / 2);
                    }
                }
            }
        }
    }
}

/* amx values, plane [D/16][N/2][16 dims][2 tokens]: each 64-byte tile splits into two 16-dim rows. */
void hurray_amx_values_2(const uint16_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                         int64_t H, int64_t N, int64_t D, uint16_t *dst) {
    const int64_t r = H * D;
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            const uint16_t *plane = base + blocks[i] * sb + h * sh;
            uint16_t *out = dst + (i * N * H + h) * D;
            for (int64_t nh = 0; nh < N / 2; nh++) {
                uint16_t *r0 = out + 2 * nh * r;
                for (int64_t dh = 0; dh < D / 16; dh++) {
                    const uint16_t *tile = plane + (dh * (N / 2) + nh) * 32;
                    for (int half = 0; half < 2; half++) {
                        /* [d0t0 d0t1 d1t0 d1t1 ...] -> low 64 bits: t0 of 4 dims, high: t1 of them. */
                        __m128i a = LD(tile + 16 * half), b = LD(tile + 16 * half + 8);
                        a = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(a, 0xD8), 0xD8), 0xD8);
                        b = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(b, 0xD8), 0xD8), 0xD8);
                        ST(r0 + dh * 16 + 8 * half, _mm_unpacklo_epi64(a, b));
                        ST(r0 + r + dh * 16 + 8 * half, _mm_unpackhi_epi64(a, b));
                    }
                }
            }
        }
    }
}

/* The inverses, into the cache. All but the vec keys run token-group-major, not plane-major: each
 * work item is a group of tokens of one block, all heads, so the interchange source ([N][H][D] per
 * block, a token's heads side by side) is read front to back. Plane by plane, it was read in rows
 * of D elements H*D apart (256 bytes every 2 KiB for 8 heads of 128), which the hardware
 * prefetchers follow poorly: the row-major values were packed at half the speed of a plain copy of
 * their bytes, now at its speed (scripts/bench_import.py, docs/benchmarks.md). */

#if defined(_OPENMP)
#define PARALLEL_ITEMS _Pragma("omp parallel for schedule(static) if (items > 1)")
#else
#define PARALLEL_ITEMS
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* vec keys with AVX2, where the CPU has it (checked at run time: the library is built for any
 * x86-64). Memory-bound with the 8x8 transposes above: each wrote 16 bytes into 8 destination rows,
 * a line completed only by later transposes, and every line was read for ownership before it was
 * written. Here 16 dims x 32 tokens are transposed in registers and each of the 16 destination rows
 * gets one whole 64-byte line, stored non-temporally (no read for ownership, no cache pollution:
 * a load's blocks are far more than the caches hold). Cold, per 32 MiB on machine A': 3.8 ms
 * against 5.9 (a copy_ of the same bytes: 2.5-3.6). */
#include <immintrin.h>
#define HURRAY_VEC_KEYS_AVX2 1

__attribute__((target("avx2"))) static void tr16x32_16_stream(const uint16_t *s, int64_t ss, uint16_t *o,
                                                             int64_t os) {
    __m256i rows[2][16];
    for (int half = 0; half < 2; half++) {
        const uint16_t *sp = s + half * 16 * ss;
        __m256i a[16], t[16], u[16], v[16];
        for (int k = 0; k < 16; k++) a[k] = _mm256_loadu_si256((const __m256i *)(sp + k * ss));
        for (int k = 0; k < 8; k++) {
            t[2 * k] = _mm256_unpacklo_epi16(a[2 * k], a[2 * k + 1]);
            t[2 * k + 1] = _mm256_unpackhi_epi16(a[2 * k], a[2 * k + 1]);
        }
        for (int k = 0; k < 4; k++) {
            u[4 * k] = _mm256_unpacklo_epi32(t[4 * k], t[4 * k + 2]);
            u[4 * k + 1] = _mm256_unpackhi_epi32(t[4 * k], t[4 * k + 2]);
            u[4 * k + 2] = _mm256_unpacklo_epi32(t[4 * k + 1], t[4 * k + 3]);
            u[4 * k + 3] = _mm256_unpackhi_epi32(t[4 * k + 1], t[4 * k + 3]);
        }
        for (int k = 0; k < 2; k++) {
            for (int j = 0; j < 4; j++) {
                v[8 * k + 2 * j] = _mm256_unpacklo_epi64(u[8 * k + j], u[8 * k + 4 + j]);
                v[8 * k + 2 * j + 1] = _mm256_unpackhi_epi64(u[8 * k + j], u[8 * k + 4 + j]);
            }
        }
        /* Lane 0 of v[j] (source rows 0-7) and of v[8 + j] (rows 8-15) make output row j; lanes 1, row j + 8. */
        for (int j = 0; j < 8; j++) {
            rows[half][j] = _mm256_permute2x128_si256(v[j], v[8 + j], 0x20);
            rows[half][j + 8] = _mm256_permute2x128_si256(v[j], v[8 + j], 0x31);
        }
    }
    for (int j = 0; j < 16; j++) {
        _mm256_stream_si256((__m256i *)(o + j * os), rows[0][j]);
        _mm256_stream_si256((__m256i *)(o + j * os + 16), rows[1][j]);
    }
}

__attribute__((target("avx2"))) static void vec_keys_put_avx2(uint16_t *base, const int64_t *blocks, int64_t i0,
                                                             int64_t i1, int64_t sb, int64_t sh, int64_t H,
                                                             int64_t N, int64_t D, const uint16_t *src) {
    const int64_t r = H * D;
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            uint16_t *plane = base + blocks[i] * sb + h * sh;
            const uint16_t *in = src + (i * N * H + h) * D;
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                for (int64_t n0 = 0; n0 < N; n0 += 32) {
                    tr16x32_16_stream(in + n0 * r + d0, r, plane + d0 * N + n0, N);
                }
            }
        }
    }
    _mm_sfence(); /* the streamed stores are ordered before anything the caller does next */
}

/* Whether vec_keys_put_avx2 applies: an AVX2 CPU, whole 32-token lines, and line-aligned rows (the
 * streamed stores need 32-byte alignment, and whole lines to be fast). */
static int vec_keys_put_avx2_fits(const uint16_t *base, int64_t sb, int64_t sh, int64_t N, int64_t D) {
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return cpu && N % 32 == 0 && D % 16 == 0 && (((uintptr_t)base | (uintptr_t)(sb * 2) | (uintptr_t)(sh * 2)) & 63) == 0;
}
#endif

void hurray_vec_keys_put_2(uint16_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                           int64_t H, int64_t N, int64_t D, const uint16_t *src) {
    if (N % 8 || D % 8) {
        hurray_vec_keys_put_2_generic(base, blocks, i0, i1, sb, sh, H, N, D, src);
        return;
    }
#ifdef HURRAY_VEC_KEYS_AVX2
    if (vec_keys_put_avx2_fits(base, sb, sh, N, D)) {
        vec_keys_put_avx2(base, blocks, i0, i1, sb, sh, H, N, D, src);
        return;
    }
#endif
    /* Plane by plane, unlike the others: each 8x8 transpose writes 16 bytes into 8 destination rows,
     * and the plane-major order, which fills those rows front to back, measured fastest of the orders
     * tried (token groups of 16 to 128, heads inside or outside them). */
    const int64_t r = H * D;
    PARALLEL_FOR
    for (int64_t ih = i0 * H; ih < i1 * H; ih++) {
        {
            const int64_t i = ih / H, h = ih % H;
            uint16_t *plane = base + blocks[i] * sb + h * sh;
            const uint16_t *in = src + (i * N * H + h) * D;
            for (int64_t d0 = 0; d0 < D; d0 += 8) {
                for (int64_t n0 = 0; n0 < N; n0 += 8) {
                    tr8x8_16(in + n0 * r + d0, r, plane + d0 * N + n0, N);
                }
            }
        }
    }
}

void hurray_amx_keys_put_2(uint16_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                           int64_t H, int64_t N, int64_t D, const uint16_t *src) {
    if (D % 8 || N % 16) {
        hurray_amx_keys_put_2_generic(base, blocks, i0, i1, sb, sh, H, N, D, src);
        return;
    }
    /* One item per 16-token group: its [D/2][16 tokens][2 dims] run of a plane is D/2 whole lines, each
     * (a dim pair of 16 tokens) assembled from four 4x4 word transposes and stored at once, past the
     * caches where the lines are aligned (as the vec keys: no read for ownership). */
    const int64_t r = H * D, groups = N / 16, items = (i1 - i0) * groups;
    const int stream = ((uintptr_t)base | (uintptr_t)(sb * 2) | (uintptr_t)(sh * 2)) % 64 == 0;
    PARALLEL_ITEMS
    for (int64_t it = 0; it < items; it++) {
        const int64_t i = i0 + it / groups, nh = it % groups;
        const uint16_t *in = src + (i * N + nh * 16) * r;
        for (int64_t h = 0; h < H; h++) {
            uint32_t *blk = (uint32_t *)(base + blocks[i] * sb + h * sh) + nh * (D / 2) * 16;
            for (int64_t dp = 0; dp < D / 2; dp += 4) {
                __m128i line[4][4]; /* [dim pair dp + j][tokens 4q .. 4q + 3] */
                for (int64_t q = 0; q < 4; q++) {
                    /* 4 tokens x 4 dim pairs (words), transposed into 4 dim pairs x 4 tokens. */
                    const uint32_t *w = (const uint32_t *)(in + 4 * q * r + h * D + 2 * dp);
                    const int64_t ws = r / 2;
                    __m128i v0 = LD(w), v1 = LD(w + ws), v2 = LD(w + 2 * ws), v3 = LD(w + 3 * ws);
                    __m128i t0 = _mm_unpacklo_epi32(v0, v1), t1 = _mm_unpackhi_epi32(v0, v1);
                    __m128i t2 = _mm_unpacklo_epi32(v2, v3), t3 = _mm_unpackhi_epi32(v2, v3);
                    line[0][q] = _mm_unpacklo_epi64(t0, t2);
                    line[1][q] = _mm_unpackhi_epi64(t0, t2);
                    line[2][q] = _mm_unpacklo_epi64(t1, t3);
                    line[3][q] = _mm_unpackhi_epi64(t1, t3);
                }
                for (int64_t j = 0; j < 4; j++) {
                    uint32_t *o = blk + (dp + j) * 16;
                    for (int64_t q = 0; q < 4; q++) {
                        if (stream)
                            _mm_stream_si128((__m128i *)(o + 4 * q), line[j][q]);
                        else
                            ST(o + 4 * q, line[j][q]);
                    }
                }
            }
        }
    }
    _mm_sfence();
}

void hurray_amx_values_put_2(uint16_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                             int64_t H, int64_t N, int64_t D, const uint16_t *src) {
    if (N % 16 || D % 16) {
        hurray_amx_values_put_2_generic(base, blocks, i0, i1, sb, sh, H, N, D, src);
        return;
    }
    /* A group of 16 tokens is 8 consecutive lines of each 16-dim band; each tile is one whole line,
     * stored past the caches where the lines are aligned. */
    const int64_t r = H * D, G = 16, groups = N / G, items = (i1 - i0) * groups;
    const int stream = ((uintptr_t)base | (uintptr_t)(sb * 2) | (uintptr_t)(sh * 2)) % 64 == 0;
    PARALLEL_ITEMS
    for (int64_t it = 0; it < items; it++) {
        const int64_t i = i0 + it / groups, n0 = it % groups * G;
        const uint16_t *in = src + (i * N + n0) * r;
        /* A token pair at a time (two 2 KiB source rows, every head), each 16-dim band's tile of the
         * pair one whole line: the source is read front to back. */
        for (int64_t np = 0; np < G / 2; np++) {
            for (int64_t h = 0; h < H; h++) {
                uint16_t *plane = base + blocks[i] * sb + h * sh;
                const uint16_t *r0 = in + 2 * np * r + h * D;
                for (int64_t dh = 0; dh < D / 16; dh++, r0 += 16) {
                    /* Two tokens' 16 dims interleaved: [d0t0 d0t1 d1t0 d1t1 ...]. */
                    uint16_t *tile = plane + (dh * (N / 2) + n0 / 2 + np) * 32;
                    __m128i a = LD(r0), b = LD(r0 + r);
                    __m128i c = LD(r0 + 8), e = LD(r0 + r + 8);
                    if (stream) {
                        _mm_stream_si128((__m128i *)tile, _mm_unpacklo_epi16(a, b));
                        _mm_stream_si128((__m128i *)(tile + 8), _mm_unpackhi_epi16(a, b));
                        _mm_stream_si128((__m128i *)(tile + 16), _mm_unpacklo_epi16(c, e));
                        _mm_stream_si128((__m128i *)(tile + 24), _mm_unpackhi_epi16(c, e));
                    } else {
                        ST(tile, _mm_unpacklo_epi16(a, b));
                        ST(tile + 8, _mm_unpackhi_epi16(a, b));
                        ST(tile + 16, _mm_unpacklo_epi16(c, e));
                        ST(tile + 24, _mm_unpackhi_epi16(c, e));
                    }
                }
            }
        }
    }
    _mm_sfence();
}

/* Row-major values: a token's heads are copied into H planes, one row each. The cache's blocks are
 * far more than the caches hold on a load, so streaming them past the caches loses nothing. */
void hurray_rows_put_2(uint16_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sh,
                       int64_t H, int64_t N, int64_t D, const uint16_t *src) {
    /* Items of 16 tokens (a 32 KiB stretch of the source for 8 heads of 128) where N allows. */
    const int64_t r = H * D, G = N % 16 ? 1 : 16, groups = N / G, items = (i1 - i0) * groups;
    /* Rows of whole lines, line-aligned: stored non-temporally (no read for ownership: 2.3 against
     * 2.9 ms per 32 MiB cold, 1 thread, machine A'), else copied. */
    const int stream = D % 32 == 0 && (((uintptr_t)base | (uintptr_t)(sb * 2) | (uintptr_t)(sh * 2)) & 63) == 0;
    PARALLEL_ITEMS
    for (int64_t it = 0; it < items; it++) {
        const int64_t i = i0 + it / groups, n0 = it % groups * G;
        const uint16_t *in = src + (i * N + n0) * r;
        uint16_t *blk = base + blocks[i] * sb + n0 * D;
        if (stream) {
            for (int64_t n = 0; n < G; n++) {
                for (int64_t h = 0; h < H; h++) {
                    const uint16_t *a = in + n * r + h * D;
                    uint16_t *o = blk + h * sh + n * D;
                    for (int64_t d = 0; d < D; d += 8) _mm_stream_si128((__m128i *)(o + d), LD(a + d));
                }
            }
        } else {
            for (int64_t n = 0; n < G; n++) {
                for (int64_t h = 0; h < H; h++) memcpy(blk + h * sh + n * D, in + n * r + h * D, (size_t)D * 2);
            }
        }
    }
    _mm_sfence();
}

#undef PARALLEL_ITEMS
#undef LD
#undef ST
