/* The host copies' whole-block kernel (engine_client/vllm/host_copy.py calls it; the numpy path there is the
 * fallback and the reference it is tested against, bit for bit).
 *
 * copy_blocks(params) moves whole vLLM blocks (host_copy's units) between a host pool layer and vLLM's CPU KV
 * in one pass, a block at a time: head by head, K then V, the block's pool pages are read and the block
 * written (a load) or the other way round (a save). A token's head that is `dim` contiguous elements on both
 * sides is one run (memcpy, or 16-byte streaming stores); CPU attention's transposed K (tokens contiguous,
 * dims `block_size` apart) moves in SIMD tiles (SSE2: 4x4 of 4 bytes, 8x8 of 2, 2x2 of 8; AVX2, where the
 * CPU has it, 8x8 of 4 bytes on loads); any other layout element by element. Elements move as integers of
 * their size (loads, shuffles and stores, no floating-point operation): every bit pattern is kept.
 *
 * What makes it fast is memory, not arithmetic (docs/vllm.md, "Copies near bandwidth"): the memory of the
 * block after next is prefetched, a share between each of this block's steps (F_PREFETCH_SRC / _DST), and
 * with F_STREAM the destination is written with non-temporal stores (no read of lines about to be
 * overwritten, nothing of the copy left in cache; an sfence before returning). One thread; the GIL is
 * released for the copy.
 *
 * `params` is a contiguous int64 buffer of PARAMS values in the enum's order (host_copy.py's `_kernel_copy`
 * builds it); the caller has checked every page and block id against the pool and vLLM's tensor
 * (BlockUnits.check) and holds the arrays the addresses point into for the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

#ifndef KVCACHE_SOURCE_HASH
#define KVCACHE_SOURCE_HASH ""
#endif

enum {
    P_LOAD, P_ITEMSIZE, P_UNITS, P_PARTS, P_PAGE_SIZE, P_HEADS, P_DIM,
    P_BLOCK_IDS, P_PAGE_IDS,             /* addresses of int64 arrays: units, units * parts */
    P_ROWS, P_ROW_STRIDE,                /* vLLM block 0's run, bytes between blocks */
    P_K_OFF, P_K_TOKEN, P_K_HEAD, P_K_DIM, /* K in a block's run: elements */
    P_V_OFF, P_V_TOKEN, P_V_HEAD, P_V_DIM,
    P_POOL_K, P_POOL_V,                  /* the pool's K and V page 0 */
    P_PAGE_STRIDE, P_POOL_TOKEN, P_POOL_HEAD, /* bytes; a head's dim elements are contiguous */
    P_FLAGS,                             /* F_* */
    PARAMS
};

typedef ptrdiff_t isize;

enum { F_STREAM = 1, F_PREFETCH_SRC = 2, F_PREFETCH_DST = 4 };

static inline void move_elem(char *dst, const char *src, isize size) {
    switch (size) {
    case 1: *(uint8_t *)dst = *(const uint8_t *)src; break;
    case 2: memcpy(dst, src, 2); break;
    case 4: memcpy(dst, src, 4); break;
    case 8: memcpy(dst, src, 8); break;
    default: memcpy(dst, src, (size_t)size);
    }
}

/* dst[c][r] = src[r][c] for r < rows, c < cols; row strides in bytes, columns contiguous on both sides. */
static void transpose_scalar(const char *src, isize src_row, char *dst, isize dst_row, isize rows, isize cols,
                             isize size) {
    for (isize r = 0; r < rows; r++)
        for (isize c = 0; c < cols; c++)
            move_elem(dst + c * dst_row + r * size, src + r * src_row + c * size, size);
}

#if defined(__SSE2__)
#define LD(p) _mm_loadu_si128((const __m128i *)(const void *)(p))

static inline void put(char *d, __m128i x, int stream) {
    if (stream) _mm_stream_si128((__m128i *)(void *)d, x);
    else _mm_storeu_si128((__m128i *)(void *)d, x);
}

/* Tiles of one 16-byte row per element row: 4x4 of 4 bytes, 8x8 of 2, 2x2 of 8. `s`/`ss`: the source's first
 * row and row stride, `d`/`ds` the destination's (bytes); with `stream`, `d` and `ds` are 16-byte aligned. */
static inline void tile4(const char *s, isize ss, char *d, isize ds, int stream) {
    __m128i r0 = LD(s), r1 = LD(s + ss), r2 = LD(s + 2 * ss), r3 = LD(s + 3 * ss);
    __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3);
    __m128i t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);
    put(d, _mm_unpacklo_epi64(t0, t1), stream);
    put(d + ds, _mm_unpackhi_epi64(t0, t1), stream);
    put(d + 2 * ds, _mm_unpacklo_epi64(t2, t3), stream);
    put(d + 3 * ds, _mm_unpackhi_epi64(t2, t3), stream);
}

static inline void tile8(const char *s, isize ss, char *d, isize ds, int stream) {
    __m128i r[8], a[8], b[8];
    for (int i = 0; i < 8; i++) r[i] = LD(s + i * ss);
    for (int i = 0; i < 4; i++) {
        a[i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[i + 4] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[2 * i] = _mm_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
    }
    /* b: columns 0-1, 2-3 of rows 0-3 and of rows 4-7, then columns 4-5, 6-7 likewise */
    for (int half = 0; half < 2; half++) {
        const __m128i *q = b + 4 * half;
        char *o = d + 4 * half * ds;
        put(o, _mm_unpacklo_epi64(q[0], q[2]), stream);
        put(o + ds, _mm_unpackhi_epi64(q[0], q[2]), stream);
        put(o + 2 * ds, _mm_unpacklo_epi64(q[1], q[3]), stream);
        put(o + 3 * ds, _mm_unpackhi_epi64(q[1], q[3]), stream);
    }
}

static inline void tile2(const char *s, isize ss, char *d, isize ds, int stream) {
    __m128i r0 = LD(s), r1 = LD(s + ss);
    put(d, _mm_unpacklo_epi64(r0, r1), stream);
    put(d + ds, _mm_unpackhi_epi64(r0, r1), stream);
}

static inline isize tile_of(isize size) { return size == 4 ? 4 : size == 2 ? 8 : size == 8 ? 2 : 0; }

static inline void tile(isize t, const char *s, isize ss, char *d, isize ds, int stream) {
    if (t == 4) tile4(s, ss, d, ds, stream);
    else if (t == 8) tile8(s, ss, d, ds, stream);
    else tile2(s, ss, d, ds, stream);
}
#endif

/* transpose_scalar's move in SIMD tiles where the element size has one, the remainder element by element. A
 * column of tiles at a time (`c` outer): each destination row fills left to right, a line at a time. */
static void transpose(const char *src, isize src_row, char *dst, isize dst_row, isize rows, isize cols,
                      isize size, int stream) {
#if defined(__SSE2__)
    isize t = tile_of(size);
    if (t) {
        isize rt = rows - rows % t, ct = cols - cols % t;
        stream = stream && (uintptr_t)dst % 16 == 0 && dst_row % 16 == 0;
        for (isize c = 0; c < ct; c += t)
            for (isize r = 0; r < rt; r += t)
                tile(t, src + r * src_row + c * size, src_row, dst + c * dst_row + r * size, dst_row, stream);
        if (ct < cols) transpose_scalar(src + ct * size, src_row, dst + ct * dst_row, dst_row, rows, cols - ct, size);
        if (rt < rows) transpose_scalar(src + rt * src_row, src_row, dst + rt * size, dst_row, rows - rt, ct, size);
        return;
    }
#endif
    (void)stream;
    transpose_scalar(src, src_row, dst, dst_row, rows, cols, size);
}

#define MAX_PARTS 64

#ifdef HAVE_AVX2_PATH
static int use_avx2;  /* set at import from the CPU's features */

/* 8x8 of 4-byte elements with AVX2: the work of four 4x4 SSE2 tiles in half the instructions. */
__attribute__((target("avx2"))) static void tile8x32(const char *s, isize ss, char *d, isize ds, int stream) {
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(const void *)(s + i * ss));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[i] (rows 0-3) and u[i + 4] (rows 4-7) hold columns i and i + 4 in their 128-bit halves */
    for (int i = 0; i < 4; i++) {
        __m256i lo = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        __m256i hi = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
        if (stream) {
            _mm256_stream_si256((__m256i *)(void *)(d + i * ds), lo);
            _mm256_stream_si256((__m256i *)(void *)(d + (i + 4) * ds), hi);
        } else {
            _mm256_storeu_si256((__m256i *)(void *)(d + i * ds), lo);
            _mm256_storeu_si256((__m256i *)(void *)(d + (i + 4) * ds), hi);
        }
    }
}

__attribute__((target("avx2"))) static void transpose_pages_avx2(const char *const *srcs, isize src_row, char *dst,
                                                                isize dst_row, isize tokens, isize parts, isize dim,
                                                                int stream) {
    stream = stream && (uintptr_t)dst % 32 == 0 && dst_row % 32 == 0;
    for (isize c = 0; c < dim; c += 8)
        for (isize part = 0; part < parts; part++)
            for (isize r = 0; r < tokens; r += 8)
                tile8x32(srcs[part] + r * src_row + c * 4, src_row, dst + c * dst_row + (part * tokens + r) * 4,
                         dst_row, stream);
}
#endif

/* A load's transposed K of one head: `parts` pool pages (`srcs`, each `tokens` rows of `dim` elements,
 * `src_row` apart) into the block's `[dim][parts * tokens]` (`dst`, rows `dst_row` apart), a column of tiles
 * across every page at a time, so each destination row is written whole, left to right, before the next
 * (a page at a time, a streamed row would be written in pieces far apart). Only where the element size has
 * a tile and `tokens` and `dim` are multiples of it: else 0, nothing moved. */
static int transpose_pages(const char *const *srcs, isize src_row, char *dst, isize dst_row, isize tokens,
                           isize parts, isize dim, isize size, int stream) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2 && size == 4 && tokens % 8 == 0 && dim % 8 == 0) {
        transpose_pages_avx2(srcs, src_row, dst, dst_row, tokens, parts, dim, stream);
        return 1;
    }
#endif
#if defined(__SSE2__)
    isize t = tile_of(size);
    if (!t || tokens % t || dim % t)
        return 0;
    stream = stream && (uintptr_t)dst % 16 == 0 && dst_row % 16 == 0;
    for (isize c = 0; c < dim; c += t)
        for (isize part = 0; part < parts; part++)
            for (isize r = 0; r < tokens; r += t)
                tile(t, srcs[part] + r * src_row + c * size, src_row, dst + c * dst_row + (part * tokens + r) * size,
                     dst_row, stream);
    return 1;
#else
    (void)srcs; (void)src_row; (void)dst; (void)dst_row; (void)tokens; (void)parts; (void)dim; (void)size;
    (void)stream;
    return 0;
#endif
}

/* memcpy, with streaming stores where asked and the destination and length allow. */
static inline void copy_run(char *dst, const char *src, isize bytes, int stream) {
#if defined(__SSE2__)
    if (stream && (uintptr_t)dst % 16 == 0 && bytes % 64 == 0) {
        for (isize i = 0; i < bytes; i += 64) {
            __m128i a = LD(src + i), b = LD(src + i + 16), c = LD(src + i + 32), d = LD(src + i + 48);
            put(dst + i, a, 1);
            put(dst + i + 16, b, 1);
            put(dst + i + 32, c, 1);
            put(dst + i + 48, d, 1);
        }
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, (size_t)bytes);
}

/* One head of one pool page (`tokens` tokens, `dim` elements each) and its place in a block: `blk` is the
 * block's element (first token, this head, dim 0), `token`/`dim_step` its strides in bytes. */
static void move_page_head(int load, const char *page_head, isize pool_token, char *blk, isize token,
                           isize dim_step, isize tokens, isize dim, isize size, int stream) {
    if (dim_step == size) {  /* a token's dim elements are one run on both sides */
        isize bytes = dim * size;
        if (token == bytes && pool_token == bytes) {
            if (load) copy_run(blk, page_head, bytes * tokens, stream);
            else copy_run((char *)page_head, blk, bytes * tokens, stream);
            return;
        }
        for (isize t = 0; t < tokens; t++) {
            if (load) copy_run(blk + t * token, page_head + t * pool_token, bytes, stream);
            else copy_run((char *)page_head + t * pool_token, blk + t * token, bytes, stream);
        }
    } else if (token == size) {  /* tokens contiguous in the block (CPU attention's K): a transpose */
        if (load) transpose(page_head, pool_token, blk, dim_step, tokens, dim, size, stream);
        else transpose(blk, dim_step, (char *)page_head, pool_token, dim, tokens, size, stream);
    } else {
        for (isize t = 0; t < tokens; t++)
            for (isize d = 0; d < dim; d++) {
                char *b = blk + t * token + d * dim_step;
                char *p = (char *)page_head + t * pool_token + d * size;
                if (load) move_elem(b, p, size);
                else move_elem(p, b, size);
            }
    }
}

#define LINE 64
#define AHEAD 2 /* blocks: prefetching the block after next measured ~3% faster than the next one */

static inline void prefetch_range(const char *at, isize bytes, int write) {
    for (isize i = 0; i < bytes; i += LINE) {
        if (write) __builtin_prefetch(at + i, 1, 3);
        else __builtin_prefetch(at + i, 0, 3);
    }
}

/* The memory of the unit AHEAD units on as ranges, prefetched a share at a time between this unit's steps (a burst of a whole
 * unit's prefetches would stall on the core's outstanding misses before this unit's work began). */
typedef struct {
    const char *at[2 * MAX_PARTS + 1];
    isize bytes[2 * MAX_PARTS + 1];
    int write[2 * MAX_PARTS + 1];
    int n, i;
    isize done, share;
} Ahead;

static void ahead_add(Ahead *a, const char *at, isize bytes, int write) {
    a->at[a->n] = at;
    a->bytes[a->n] = bytes;
    a->write[a->n++] = write;
}

static void ahead_step(Ahead *a) {
    isize left = a->share;
    while (left > 0 && a->i < a->n) {
        isize take = a->bytes[a->i] - a->done < left ? a->bytes[a->i] - a->done : left;
        prefetch_range(a->at[a->i] + a->done, take, a->write[a->i]);
        left -= take;
        a->done += take;
        if (a->done >= a->bytes[a->i]) {
            a->i++;
            a->done = 0;
        }
    }
}

static void copy_blocks_impl(const int64_t *p) {
    const int load = (int)p[P_LOAD];
    const isize size = p[P_ITEMSIZE], units = p[P_UNITS], parts = p[P_PARTS], page_size = p[P_PAGE_SIZE];
    const isize heads = p[P_HEADS], dim = p[P_DIM];
    const int64_t *block_ids = (const int64_t *)(uintptr_t)p[P_BLOCK_IDS];
    const int64_t *page_ids = (const int64_t *)(uintptr_t)p[P_PAGE_IDS];
    char *rows = (char *)(uintptr_t)p[P_ROWS];
    const isize row_stride = p[P_ROW_STRIDE];
    char *pool[2] = {(char *)(uintptr_t)p[P_POOL_K], (char *)(uintptr_t)p[P_POOL_V]};
    const isize page_stride = p[P_PAGE_STRIDE], pool_token = p[P_POOL_TOKEN], pool_head = p[P_POOL_HEAD];
    const isize page_bytes = (page_size - 1) * pool_token + heads * pool_head;
    const isize block_bytes = 2 * page_size * parts * heads * dim * size;
    const int flags = (int)p[P_FLAGS], stream = flags & F_STREAM;
    const int pf_pool = flags & (load ? F_PREFETCH_SRC : F_PREFETCH_DST);
    const int pf_block = flags & (load ? F_PREFETCH_DST : F_PREFETCH_SRC);
    for (isize u = 0; u < units; u++) {
        char *block = rows + block_ids[u] * row_stride;
        Ahead ahead = {.n = 0};
        if (u + AHEAD < units && parts <= MAX_PARTS) {
            if (pf_pool)
                for (isize part = 0; part < parts; part++)
                    for (int which = 0; which < 2; which++)
                        ahead_add(&ahead, pool[which] + page_ids[(u + AHEAD) * parts + part] * page_stride, page_bytes,
                                  !load);
            if (pf_block)
                ahead_add(&ahead, rows + block_ids[u + AHEAD] * row_stride, block_bytes, load);
            isize total = 0;
            for (int i = 0; i < ahead.n; i++) total += ahead.bytes[i];
            ahead.share = (total + 2 * heads - 1) / (2 * heads);
        }
        /* head by head, K then V: with CPU attention's packing that writes the block in order */
        for (isize h = 0; h < heads; h++)
            for (int which = 0; which < 2; which++) {
                ahead_step(&ahead);
                const int64_t *at = p + (which ? P_V_OFF : P_K_OFF);
                const isize token = at[1] * size, dim_step = at[3] * size;
                char *head_at = block + (at[0] + h * at[2]) * size;
                if (load && token == size && dim_step != size && parts <= MAX_PARTS) {
                    const char *srcs[MAX_PARTS];
                    for (isize part = 0; part < parts; part++)
                        srcs[part] = pool[which] + page_ids[u * parts + part] * page_stride + h * pool_head;
                    if (transpose_pages(srcs, pool_token, head_at, dim_step, page_size, parts, dim, size, stream))
                        continue;
                }
                for (isize part = 0; part < parts; part++) {
                    const char *page = pool[which] + page_ids[u * parts + part] * page_stride;
                    move_page_head(load, page + h * pool_head, pool_token, head_at + part * page_size * token, token,
                                   dim_step, page_size, dim, size, stream);
                }
            }
    }
#if defined(__SSE2__)
    if (stream)
        _mm_sfence();  /* streaming stores are weakly ordered: done before the caller reads or hands on the memory */
#endif
}

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*:copy_blocks", &buf))
        return NULL;
    if (buf.len != (Py_ssize_t)(PARAMS * sizeof(int64_t))) {
        PyErr_Format(PyExc_ValueError, "copy_blocks takes %d int64 parameters, got %zd bytes", PARAMS, buf.len);
        PyBuffer_Release(&buf);
        return NULL;
    }
    int64_t params[PARAMS];
    memcpy(params, buf.buf, sizeof(params));
    PyBuffer_Release(&buf);
    Py_BEGIN_ALLOW_THREADS
    copy_blocks_impl(params);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(params): move whole vLLM blocks between a host pool layer and vLLM's CPU KV (a load or a "
     "save), `params` a contiguous int64 buffer of PARAMS values (engine_client/vllm/host_copy.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "engine_client.vllm._block_copy",
    "The host copies' whole-block kernel (engine_client/vllm/host_copy.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__block_copy(void) {
    const char *tiles = "no SIMD tiles";
#if defined(__SSE2__)
    tiles = "SIMD tiles: sse2";
#endif
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
    if (use_avx2)
        tiles = "SIMD tiles: avx2 and sse2";
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "PARAMS", PARAMS) < 0
        || PyModule_AddIntConstant(m, "STREAM", F_STREAM) < 0
        || PyModule_AddIntConstant(m, "PREFETCH_SRC", F_PREFETCH_SRC) < 0
        || PyModule_AddIntConstant(m, "PREFETCH_DST", F_PREFETCH_DST) < 0
        || PyModule_AddStringConstant(m, "SOURCE_HASH", KVCACHE_SOURCE_HASH) < 0
        || PyModule_AddStringConstant(m, "TILES", tiles) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
