/* The host copies' whole-block kernel (engine_client/vllm/host_copy.py calls it; the numpy path there is the
 * fallback and the reference it is tested against).
 *
 * copy_blocks(params) moves whole vLLM blocks between a host pool layer and vLLM's CPU KV in one pass per
 * block: for each unit, for K then V, for each head, the unit's pool pages are read and the block's K or V
 * written (a load) or the other way round (a save). A run that is contiguous on both sides (a token's head
 * of `dim` elements where the block keeps `dim` contiguous) is one memcpy; CPU attention's transposed K
 * (tokens contiguous, dims `block_size` apart) is moved in 4x4 (4-byte), 8x8 (2-byte) or 2x2 (8-byte)
 * tiles with SSE2 shuffles; anything else element by element. Elements move as integers of their size
 * (loads, shuffles and stores only, no floating-point operation), so every bit pattern is kept. One thread;
 * the GIL is released for the copy.
 *
 * `params` is a contiguous int64 buffer of PARAMS values (host_copy.py's `_kernel_params` builds it); the
 * caller has checked every page and block id against the pool and vLLM's tensor (BlockUnits.check) and
 * holds the arrays the addresses point into for the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
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
    PARAMS
};

typedef ptrdiff_t isize;

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
#define ST(p, x) _mm_storeu_si128((__m128i *)(void *)(p), (x))

static inline void tile4(const char *s, isize ss, char *d, isize ds) {
    __m128i r0 = LD(s), r1 = LD(s + ss), r2 = LD(s + 2 * ss), r3 = LD(s + 3 * ss);
    __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3);
    __m128i t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);
    ST(d, _mm_unpacklo_epi64(t0, t1));
    ST(d + ds, _mm_unpackhi_epi64(t0, t1));
    ST(d + 2 * ds, _mm_unpacklo_epi64(t2, t3));
    ST(d + 3 * ds, _mm_unpackhi_epi64(t2, t3));
}

static inline void tile8(const char *s, isize ss, char *d, isize ds) {
    __m128i r[8], a[8], b[8];
    for (int i = 0; i < 8; i++) r[i] = LD(s + i * ss);
    for (int i = 0; i < 4; i++) {
        a[i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[i + 4] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    b[0] = _mm_unpacklo_epi32(a[0], a[1]); b[1] = _mm_unpackhi_epi32(a[0], a[1]);
    b[2] = _mm_unpacklo_epi32(a[2], a[3]); b[3] = _mm_unpackhi_epi32(a[2], a[3]);
    b[4] = _mm_unpacklo_epi32(a[4], a[5]); b[5] = _mm_unpackhi_epi32(a[4], a[5]);
    b[6] = _mm_unpacklo_epi32(a[6], a[7]); b[7] = _mm_unpackhi_epi32(a[6], a[7]);
    ST(d, _mm_unpacklo_epi64(b[0], b[2]));
    ST(d + ds, _mm_unpackhi_epi64(b[0], b[2]));
    ST(d + 2 * ds, _mm_unpacklo_epi64(b[1], b[3]));
    ST(d + 3 * ds, _mm_unpackhi_epi64(b[1], b[3]));
    ST(d + 4 * ds, _mm_unpacklo_epi64(b[4], b[6]));
    ST(d + 5 * ds, _mm_unpackhi_epi64(b[4], b[6]));
    ST(d + 6 * ds, _mm_unpacklo_epi64(b[5], b[7]));
    ST(d + 7 * ds, _mm_unpackhi_epi64(b[5], b[7]));
}

static inline void tile2(const char *s, isize ss, char *d, isize ds) {
    __m128i r0 = LD(s), r1 = LD(s + ss);
    ST(d, _mm_unpacklo_epi64(r0, r1));
    ST(d + ds, _mm_unpackhi_epi64(r0, r1));
}
#endif

/* The transpose of transpose_scalar, in SIMD tiles where the element size has one and the remainder apart. */
static void transpose(const char *src, isize src_row, char *dst, isize dst_row, isize rows, isize cols,
                      isize size) {
#if defined(__SSE2__)
    isize t = size == 4 ? 4 : size == 2 ? 8 : size == 8 ? 2 : 0;
    if (t) {
        isize rt = rows - rows % t, ct = cols - cols % t;
        for (isize r = 0; r < rt; r += t)
            for (isize c = 0; c < ct; c += t) {
                const char *s = src + r * src_row + c * size;
                char *d = dst + c * dst_row + r * size;
                if (t == 4) tile4(s, src_row, d, dst_row);
                else if (t == 8) tile8(s, src_row, d, dst_row);
                else tile2(s, src_row, d, dst_row);
            }
        if (ct < cols) transpose_scalar(src + ct * size, src_row, dst + ct * dst_row, dst_row, rows, cols - ct, size);
        if (rt < rows) transpose_scalar(src + rt * src_row, src_row, dst + rt * size, dst_row, rows - rt, ct, size);
        return;
    }
#endif
    transpose_scalar(src, src_row, dst, dst_row, rows, cols, size);
}

/* One head of one pool page (`tokens` tokens, `dim` elements each) and its place in a block: `blk` is the
 * block's element (first token, this head, dim 0), `token`/`dim_step` its strides in bytes. */
static void move_page_head(int load, const char *page_head, isize pool_token, char *blk, isize token,
                           isize dim_step, isize tokens, isize dim, isize size) {
    if (dim_step == size) {  /* a token's dim elements are one run on both sides */
        isize bytes = dim * size;
        if (token == bytes && pool_token == bytes) {
            if (load) memcpy(blk, page_head, (size_t)(bytes * tokens));
            else memcpy((char *)page_head, blk, (size_t)(bytes * tokens));
            return;
        }
        for (isize t = 0; t < tokens; t++) {
            if (load) memcpy(blk + t * token, page_head + t * pool_token, (size_t)bytes);
            else memcpy((char *)page_head + t * pool_token, blk + t * token, (size_t)bytes);
        }
    } else if (token == size) {  /* tokens contiguous in the block (CPU attention's K): a transpose */
        if (load) transpose(page_head, pool_token, blk, dim_step, tokens, dim, size);
        else transpose(blk, dim_step, (char *)page_head, pool_token, dim, tokens, size);
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

static inline void prefetch_range(const char *at, isize bytes, int write) {
    for (isize i = 0; i < bytes; i += LINE) {
        if (write) __builtin_prefetch(at + i, 1, 3);
        else __builtin_prefetch(at + i, 0, 3);
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
    for (isize u = 0; u < units; u++) {
        char *block = rows + block_ids[u] * row_stride;
        if (u + 1 < units) {  /* the next unit's source and destination, while this one's move */
            for (isize part = 0; part < parts; part++)
                for (int which = 0; which < 2; which++)
                    prefetch_range(pool[which] + page_ids[(u + 1) * parts + part] * page_stride, page_bytes, !load);
            prefetch_range(rows + block_ids[u + 1] * row_stride, block_bytes, load);
        }
        for (int which = 0; which < 2; which++) {
            const int64_t *at = p + (which ? P_V_OFF : P_K_OFF);
            const isize off = at[0] * size, token = at[1] * size, head = at[2] * size, dim_step = at[3] * size;
            for (isize h = 0; h < heads; h++)
                for (isize part = 0; part < parts; part++) {
                    const char *page = pool[which] + page_ids[u * parts + part] * page_stride;
                    move_page_head(load, page + h * pool_head, pool_token,
                                   block + off + part * page_size * token + h * head, token, dim_step, page_size,
                                   dim, size);
                }
        }
    }
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
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "PARAMS", PARAMS) < 0
        || PyModule_AddStringConstant(m, "SOURCE_HASH", KVCACHE_SOURCE_HASH) < 0
        || PyModule_AddIntConstant(m, "SIMD", 
#if defined(__SSE2__)
                                   1
#else
                                   0
#endif
                                   ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
