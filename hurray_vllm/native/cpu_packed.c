/*
 * Transposing copies out of vLLM's CPU-backend KV cache planes into the
 * Hurray interchange layout [pages, block_size, heads, head_dim].
 *
 * torch's strided copy runs these layouts through 2- to 16-element inner
 * loops (the packed tiles are 4 to 32 bytes wide), three to four times
 * slower than a plain copy of the same bytes. These loops read each source
 * plane front to back and write whole destination rows, which keeps the
 * copy near memory speed. The layouts are described in
 * hurray_vllm/adapters/vllm/layouts.py (CpuPacked) and docs/vllm-layouts.md.
 *
 * Every function copies blocks i0 <= i < i1 of `blocks`, all heads:
 *   source plane of (block b, head h): base + b * sb + h * sh   (elements)
 *   destination element (i, n, h, d):  dst[((i * N + n) * H + h) * D + d]
 * Built with -fopenmp where the compiler can, the (block, head) planes are
 * split across OpenMP threads: loaded into a process that runs torch, the
 * library binds to the libgomp torch already loaded (same soname), so it
 * uses torch's thread pool and thread count instead of competing with it.
 * Plain C, no Python or torch headers: built with the system compiler on
 * first use (hurray_vllm/native/__init__.py) and loaded through ctypes.
 */
#define _POSIX_C_SOURCE 200809L /* read() for crc32c.h under -std=c11 */
#include <errno.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>

#if defined(_OPENMP)
#define PARALLEL_FOR _Pragma("omp parallel for schedule(static) if (i1 - i0 > 1)")
#else
#define PARALLEL_FOR
#endif

/* P, the AMX pair width: 2 elements for 8- and 16-bit types, 1 for 32-bit ones. */
#define T uint8_t
#define SUF 1
#define P 2
#include "cpu_packed_body.h"
#undef T
#undef SUF
#undef P

/* 16-bit: the portable loops as *_2_generic; with SSE2 (every x86-64) the *_2 entry points are the
 * vectorised versions below, otherwise the portable loops under that name. */
#define T uint16_t
#define SUF 2_generic
#define P 2
#include "cpu_packed_body.h"
#undef T
#undef SUF
#undef P

#if defined(__SSE2__)
#include "cpu_packed_sse2.h"
#else
#define T uint16_t
#define SUF 2
#define P 2
#include "cpu_packed_body.h"
#undef T
#undef SUF
#undef P
#endif

#define T uint32_t
#define SUF 4
#define P 1
#include "cpu_packed_body.h"
#undef T
#undef SUF
#undef P

/* The chunk checksum (hurray_vllm.chunks.store.ChunkDigest). */
#include "crc32c.h"

/* Feeds segments to a byte-consuming function of another library (OpenSSL's EVP_MAC_update for
 * a chunk's Poly1305), in order, in one call: a caller on a helper thread then gives up and takes
 * back the GIL once per chunk, not once per page pool while the engine's thread holds it.
 * Returns 0, or 1 + the index of the first segment `update` refused (returned other than 1). */
typedef int (*hurray_update_fn)(void *ctx, const unsigned char *data, size_t len);

int hurray_update_segments(hurray_update_fn update, void *ctx, const uint64_t *addrs, const uint64_t *lens,
                           size_t n) {
    for (size_t i = 0; i < n; i++)
        if (lens[i] && update(ctx, (const unsigned char *)(uintptr_t)addrs[i], (size_t)lens[i]) != 1)
            return (int)i + 1;
    return 0;
}

/* vLLM 0.32's logical [B, H, N, 2*D] cache (LogicalBHNC in hurray_vllm/adapters/vllm/layouts.py), any of the
 * KVCacheLayout stride orders whose innermost axis is C: each (block, token, head) row holds the key's D
 * elements, then the value's D. Two index_selects (keys, then values) stream every block from memory twice
 * and copy in Db-byte pieces; this reads each row once and writes its two halves to their pools.
 *   source row of (selected block i, token n, head h): base + blocks[i] * sb + n * sn + h * sh   (bytes)
 *   its first Db bytes to k_out + ((i * N + n) * H + h) * Db, the next Db bytes to v_out at the same offset.
 * Byte-generic (Db = D * element size): the element type does not matter to a copy. Blocks i0 <= i < i1;
 * the (block, token) pairs are split across OpenMP threads. The caller checks every index is in range.
 * memcpy per half: as fast as a byte loop, or 64-byte pieces, and as a plain copy_ of the same bytes (measured
 * on a 2-vCPU AVX-512 EPYC, 256-byte halves; docs/benchmarks.md "NHD export: one pass over each row"). */
void hurray_kv_rows(const uint8_t *base, const int64_t *blocks, int64_t i0, int64_t i1, int64_t sb, int64_t sn,
                    int64_t sh, int64_t N, int64_t H, int64_t Db, uint8_t *k_out, uint8_t *v_out) {
    PARALLEL_FOR
    for (int64_t in = i0 * N; in < i1 * N; in++) {
        const int64_t i = in / N, n = in % N;
        const uint8_t *row = base + blocks[i] * sb + n * sn;
        const int64_t off = in * H * Db;
        uint8_t *k = k_out + off, *v = v_out + off;
        for (int64_t h = 0; h < H; h++, row += sh, k += Db, v += Db) {
            memcpy(k, row, (size_t)Db);
            memcpy(v, row + Db, (size_t)Db);
        }
    }
}
