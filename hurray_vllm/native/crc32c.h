/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as hurray_vllm/crc32c.py computes it:
 * hurray_crc32c(crc, p, n) continues from `crc` (0 to start) and returns the finished value.
 * With SSE4.2 (checked at run time) the crc32 instruction does 8 bytes per step, several times
 * faster than zlib's table-driven CRC-32; without it a slicing-by-8 table loop does the same.
 * Where the CPU has AVX-512 and VPCLMULQDQ (checked at run time too), inputs of 1 KiB and more
 * are folded with carry-less multiplications instead, about twice as fast again. */
#include <stddef.h>
#include <string.h>

static uint32_t crc32c_table[8][256];
static int crc32c_ready;

static void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc32c_table[t][i] = (crc32c_table[t - 1][i] >> 8) ^ crc32c_table[0][crc32c_table[t - 1][i] & 0xFF];
    crc32c_ready = 1;
}

static uint32_t crc32c_sw(uint32_t c, const uint8_t *p, size_t n) {
    if (!crc32c_ready) crc32c_init(); /* only without a load-time constructor (see crc32c_tables) */
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = crc32c_table[7][w & 0xFF] ^ crc32c_table[6][(w >> 8) & 0xFF] ^ crc32c_table[5][(w >> 16) & 0xFF] ^
            crc32c_table[4][(w >> 24) & 0xFF] ^ crc32c_table[3][(w >> 32) & 0xFF] ^
            crc32c_table[2][(w >> 40) & 0xFF] ^ crc32c_table[1][(w >> 48) & 0xFF] ^ crc32c_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc32c_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <nmmintrin.h>

/* The crc32 instruction has a latency of 3 cycles and a throughput of 1: one dependency chain
 * leaves two thirds of it idle. Long inputs are therefore cut into blocks of three lanes of
 * LANE bytes, checksummed side by side, and the lanes' registers combined. The register is a
 * polynomial over GF(2) (reflected: bit 31 is x^0) and running a lane of n bytes from a
 * register r gives r * x^(8n) mod P xor the lane's checksum from 0, so combining needs one
 * multiplication by x^(8 * LANE), done through four byte tables. */
#define LANE 4096

static uint32_t crc32c_shift[4][256];
static int crc32c_shift_ready;

static uint32_t gf2_mulmod(uint32_t a, uint32_t b) {
    uint32_t prod = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) { /* a's terms from x^0 up; b times x each step */
        if (a & m) prod ^= b;
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return prod;
}

static void crc32c_shift_init(void) {
    uint32_t x8 = 1u << 23, op = 1u << 31; /* x^8, x^0 */
    for (int i = 0; i < LANE; i++) op = gf2_mulmod(op, x8);
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) crc32c_shift[k][v] = gf2_mulmod(op, v << (8 * k));
    crc32c_shift_ready = 1;
}

static inline uint32_t crc32c_shift_lane(uint32_t c) {
    return crc32c_shift[0][c & 0xFF] ^ crc32c_shift[1][(c >> 8) & 0xFF] ^ crc32c_shift[2][(c >> 16) & 0xFF] ^
           crc32c_shift[3][c >> 24];
}

/* The three LANE-byte lanes at p run side by side from registers r[0..2], left in r. */
__attribute__((target("sse4.2"))) static inline void crc32c_three(const uint8_t *p, uint64_t r[3]) {
    uint64_t a = r[0], b = r[1], d = r[2];
    for (size_t i = 0; i < LANE; i += 8) {
        uint64_t w0, w1, w2;
        memcpy(&w0, p + i, 8);
        memcpy(&w1, p + LANE + i, 8);
        memcpy(&w2, p + 2 * LANE + i, 8);
        a = _mm_crc32_u64(a, w0);
        b = _mm_crc32_u64(b, w1);
        d = _mm_crc32_u64(d, w2);
    }
    r[0] = a, r[1] = b, r[2] = d;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_lanes(uint32_t c, const uint8_t *p, size_t n) {
    if (n >= 3 * LANE && !crc32c_shift_ready) crc32c_shift_init(); /* likewise */
    while (n >= 3 * LANE) {
        uint64_t r[3] = {c, 0, 0};
        crc32c_three(p, r);
        c = crc32c_shift_lane(crc32c_shift_lane((uint32_t)r[0]) ^ (uint32_t)r[1]) ^ (uint32_t)r[2];
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c64;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}

/* ---- Folding with carry-less multiplication (VPCLMULQDQ, 512-bit registers) ----
 *
 * The crc32 instruction does 8 bytes a cycle at best, however many lanes run side by side: about
 * 16-20 GB/s, below what memory and cache deliver. Folding does 64 bytes per carry-less multiply
 * pair: four 512-bit accumulators cover 256 bytes, and each step moves them 256 bytes on and adds
 * the next 256. In the reflected bit order (a byte stream's first bit is its polynomial's highest
 * term), an accumulator lane X = H x^64 + L that has D more bits of message after it contributes
 * X x^D, congruent mod P to H (x^(64+D) mod P) + L (x^D mod P): two 64x32-bit products that fit a
 * 128-bit lane, which the next bytes are added to. Multiplied as reflected 64-bit words, the
 * product lands one term higher than the lane's own order, so each constant is x^(n-1) mod P
 * rather than x^n (checked against the bitwise definition in the tests). The last accumulator is
 * finished with the crc32 instruction (its CRC is the message's so far); the initial register is
 * added to the message's first 32 bits. The constants are computed at load time (crc32c_tables). */

static uint64_t fold_k[4][2]; /* per fold distance: 512, 1024 (unused), 2048 bits; 128, 256, 384 below */
static uint64_t fold_lane_k[3][2];

static uint64_t xpow_mod_reflected(unsigned n) {
    /* x^(n-1) mod P as a 64-bit word in the reflected order (bit j is the term x^(63-j)). */
    uint64_t r = 1; /* x^0, normal order: bit i is x^i; P = x^32 + 0x1EDC6F41 */
    for (unsigned i = 0; i + 1 < n; i++) {
        r <<= 1;
        if (r >> 32) r ^= 0x11EDC6F41ull;
    }
    uint64_t w = 0;
    for (int i = 0; i < 32; i++)
        if (r >> i & 1) w |= 1ull << (63 - i);
    return w;
}

static void crc32c_fold_init(void) {
    const unsigned dist[4] = {512, 1024, 2048, 4096};
    for (int i = 0; i < 4; i++) {
        fold_k[i][0] = xpow_mod_reflected(64 + dist[i]); /* multiplies H, the lane's low quadword */
        fold_k[i][1] = xpow_mod_reflected(dist[i]);      /* multiplies L, its high quadword */
    }
    for (int i = 0; i < 3; i++) {
        fold_lane_k[i][0] = xpow_mod_reflected(64 + 128 * (i + 1));
        fold_lane_k[i][1] = xpow_mod_reflected(128 * (i + 1));
    }
}

#define FOLD_MIN 1024 /* below, the crc32 instruction (the fold's set-up and finish cost ~100 cycles) */

__attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,sse4.2"))) static inline __m512i fold512(__m512i x, __m512i k,
                                                                                             __m512i data) {
    __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00), hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, data, 0x96); /* lo ^ hi ^ data */
}

__attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,sse4.2"))) static inline __m128i fold128(__m128i x, int i) {
    __m128i k = _mm_set_epi64x((long long)fold_lane_k[i][1], (long long)fold_lane_k[i][0]);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

/* The raw register after n bytes at p (n >= 256, any alignment) from register c; n - n % 256 bytes
 * are folded, the rest run through the crc32 instruction. */
__attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,sse4.2"))) static uint32_t crc32c_fold(uint32_t c, const uint8_t *p,
                                                                                         size_t n) {
    __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64), a2 = _mm512_loadu_si512(p + 128),
            a3 = _mm512_loadu_si512(p + 192);
    a0 = _mm512_xor_si512(a0, _mm512_castsi128_si512(_mm_cvtsi32_si128((int)c)));
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_k[2][1], (long long)fold_k[2][0]));
    size_t done = 256;
    for (; done + 256 <= n; done += 256) {
        const uint8_t *q = p + done;
        a0 = fold512(a0, k2048, _mm512_loadu_si512(q));
        a1 = fold512(a1, k2048, _mm512_loadu_si512(q + 64));
        a2 = fold512(a2, k2048, _mm512_loadu_si512(q + 128));
        a3 = fold512(a3, k2048, _mm512_loadu_si512(q + 192));
    }
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_k[0][1], (long long)fold_k[0][0]));
    a1 = fold512(a0, k512, a1);
    a2 = fold512(a1, k512, a2);
    a3 = fold512(a2, k512, a3);
    __m128i x = _mm512_extracti32x4_epi32(a3, 3);
    x = _mm_xor_si128(x, fold128(_mm512_extracti32x4_epi32(a3, 2), 0));
    x = _mm_xor_si128(x, fold128(_mm512_extracti32x4_epi32(a3, 1), 1));
    x = _mm_xor_si128(x, fold128(_mm512_castsi512_si128(a3), 2));
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(x, 1));
    return crc32c_lanes((uint32_t)r, p + done, n - done);
}

static int crc32c_fold_can(void) {
    return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("vpclmulqdq");
}

static int crc32c_fold_ok; /* the CPU folds (set at load time); hurray_crc32c_fold() turns it off for comparisons */

static uint32_t crc32c_hw(uint32_t c, const uint8_t *p, size_t n) {
    return n >= FOLD_MIN && crc32c_fold_ok ? crc32c_fold(c, p, n) : crc32c_lanes(c, p, n);
}

/* Raw registers (from 0, not inverted) of the `pages` whole LANE-byte pages at p, three side by
 * side as above: what a file's reader computes for each piece it reads while the piece is still
 * in cache, and hurray_crc32c_ranges combines later without reading the bytes again. */
__attribute__((target("sse4.2"))) static void crc32c_pages_hw(const uint8_t *p, size_t pages, uint32_t *out) {
    size_t i = 0;
    if (crc32c_fold_ok) {
        for (; i < pages; i++) out[i] = crc32c_fold(0, p + i * LANE, LANE);
        return;
    }
    for (; i + 3 <= pages; i += 3) {
        uint64_t r[3] = {0, 0, 0};
        crc32c_three(p + i * LANE, r);
        out[i] = (uint32_t)r[0];
        out[i + 1] = (uint32_t)r[1];
        out[i + 2] = (uint32_t)r[2];
    }
    for (; i < pages; i++) out[i] = crc32c_lanes(0, p + i * LANE, LANE);
}
#define HAVE_CRC32C_HW 1
#endif

#if defined(__GNUC__) || defined(__clang__)
/* The tables are filled when the library is loaded, before any thread can checksum. Filled
 * lazily, a thread could see a ready flag set by another thread before that thread's table
 * stores (a plain flag orders nothing): its checksum would be wrong, and a good chunk refused
 * as corrupt. */
__attribute__((constructor)) static void crc32c_tables(void) {
    crc32c_init();
#ifdef HAVE_CRC32C_HW
    crc32c_shift_init();
    crc32c_fold_init();
    crc32c_fold_ok = crc32c_fold_can();
#endif
}
#endif

uint32_t hurray_crc32c(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t c = ~crc;
#ifdef HAVE_CRC32C_HW
    if (__builtin_cpu_supports("sse4.2")) return ~crc32c_hw(c, p, n);
#endif
    return ~crc32c_sw(c, p, n);
}

/* 1 when hurray_crc32c uses the crc32 instruction here (for messages and benchmarks). */
int hurray_crc32c_hw(void) {
#ifdef HAVE_CRC32C_HW
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    return 0;
#endif
}

/* CRC-32C of n memory segments one after another (as one message), continuing from crc.
 * One call for a whole chunk's page pools: a caller on a helper thread gives up and takes
 * back the GIL once, not once per pool while another thread holds it. */
uint32_t hurray_crc32c_segments(uint32_t crc, const uint64_t *addrs, const uint64_t *lens, size_t n) {
    for (size_t i = 0; i < n; i++) crc = hurray_crc32c(crc, (const uint8_t *)(uintptr_t)addrs[i], (size_t)lens[i]);
    return crc;
}

/* ---- Checksums of a file's byte ranges from the page registers its reader computed ----
 *
 * A chunk's digest covers its page pools, which lie in the file's bytes. Checksummed after the
 * whole file is read, every byte comes from memory a second time (the read's copy was the first);
 * checksummed piece by piece as the read goes, it comes from cache. The reader cannot know the
 * pools' ranges before it parses the file, so it keeps one register per LANE-byte page of the file
 * (hurray_read_crc32c_pages), and the check combines them per range (hurray_crc32c_ranges): one
 * table multiplication per page, plus the partial pages at a range's ends, read again. */

/* Read n bytes of file descriptor fd into buf (from its current offset), and the raw register of
 * every whole LANE-byte page of buf into pages[] (n / LANE of them) as each piece arrives.
 * Returns the bytes read (fewer than n at the end of the file) or -errno. pages may be NULL
 * (no crc32 instruction here: see hurray_crc32c_pages_ok): then this is a plain read. One call
 * per file: the caller gives up the GIL once, not once per piece. */
#define READ_PIECE (256 * 1024) /* a multiple of LANE that fits in any x86-64's L2 */
int64_t hurray_read_crc32c_pages(int fd, uint8_t *buf, size_t n, uint32_t *pages) {
    size_t got = 0, done = 0; /* bytes read, whole pages checksummed */
    while (got < n) {
        size_t want = n - got < READ_PIECE ? n - got : READ_PIECE;
        ssize_t k = read(fd, buf + got, want);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (k == 0) break;
        got += (size_t)k;
#ifdef HAVE_CRC32C_HW
        if (pages != NULL && got / LANE > done) {
            crc32c_pages_hw(buf + done * LANE, got / LANE - done, pages + done);
            done = got / LANE;
        }
#endif
    }
    (void)done;
    return (int64_t)got;
}

/* 1 when hurray_read_crc32c_pages fills pages here (the crc32 instruction is available). */
int hurray_crc32c_pages_ok(void) { return hurray_crc32c_hw(); }

/* CRC-32C continuing from crc over n ranges base[offs[i] .. offs[i] + lens[i]) one after another,
 * as hurray_crc32c_segments would give for them. pages[k] is the raw register of base's whole page
 * k (k < npages), as hurray_read_crc32c_pages computed it; the caller keeps every range inside
 * base's bytes. Partial pages at a range's ends are checksummed from base. */
uint32_t hurray_crc32c_ranges(uint32_t crc, const uint8_t *base, const uint32_t *pages, size_t npages,
                              const uint64_t *offs, const uint64_t *lens, size_t n) {
#ifdef HAVE_CRC32C_HW
    if (!__builtin_cpu_supports("sse4.2")) pages = NULL;
#else
    pages = NULL;
#endif
    for (size_t i = 0; i < n; i++) {
        uint64_t a = offs[i], e = offs[i] + lens[i];
        if (pages == NULL) {
            crc = hurray_crc32c(crc, base + a, (size_t)(e - a));
            continue;
        }
#ifdef HAVE_CRC32C_HW
        uint32_t c = ~crc;
        uint64_t first = (a + LANE - 1) / LANE; /* the first whole page at or after a */
        uint64_t head = first * LANE < e ? first * LANE : e;
        c = crc32c_hw(c, base + a, (size_t)(head - a));
        a = head;
        while (a + LANE <= e && a / LANE < npages) {
            c = crc32c_shift_lane(c) ^ pages[a / LANE];
            a += LANE;
        }
        c = crc32c_hw(c, base + a, (size_t)(e - a));
        crc = ~c;
#endif
    }
    return crc;
}

/* 1 when long checksums fold with VPCLMULQDQ here; on = 0 turns folding off (1 back on, where the CPU
 * can), -1 only asks. For tests and benchmarks that compare the two ways; not thread-safe. */
int hurray_crc32c_fold(int on) {
#ifdef HAVE_CRC32C_HW
    if (on >= 0) crc32c_fold_ok = on && crc32c_fold_can();
    return crc32c_fold_ok;
#else
    (void)on;
    return 0;
#endif
}
