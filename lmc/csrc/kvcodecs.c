/* The KV codecs' CPU kernels: one pass over a slice of layers, the GIL released.
 *
 * Why C: the torch formulation of a codec (lmc/storage/kvcodecs/) is 8-12 whole-tensor passes
 * (widen, abs, max, divide, round, clamp, narrow, pack...), each a trip through memory, and
 * decoded far slower than a disk reads. Here each group of values is read once to find its
 * range and once to quantize it while it is still in cache, and decoding is one read of the
 * codes and one write of the values. The stored bytes are the torch path's, bit for bit
 * (tests/storage/kvcodecs/test_native.py): the same fp32 arithmetic in the same order
 * (compiled with -ffp-contract=off: no fused multiply-adds), round-half-even everywhere.
 *
 * Layouts (one layer's block; see the Python modules for why):
 *   fp8-e4m3: scales [planes][heads] f32, codes [planes][tokens][width] e4m3
 *   int8:     scales [planes][tokens][heads] f32, codes [planes][tokens][width] i8
 *   int4-kivi, per plane: codes ceil(tokens*width/2) bytes (row-major, low nibble first),
 *             scales then zero points f16: keys [token groups][width], values
 *             [tokens][channel groups]
 * Every function returns 0, or 1 when a value is not finite (or, int4, past the f16 range):
 * the caller then stores the chunk exact.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TINY 0x1p-100f
#define E4M3_MAX 448.0f
#define FP16_LIMIT 60000.0f

enum { F32 = 0, F16 = 1, BF16 = 2 };

static float e4m3_values[256];

/* Round half to even, clamp, max: inline and vectorisable (baseline x86-64 has no rounding
 * instruction, so nearbyintf is a library call per value; fminf/fmaxf are too unless NaNs
 * are ruled out, and every value reaching these is finite: checked first). */
static inline float rne(float x) { /* |x| < 2^23 */
    const float big = 8388608.0f;
    float a = fabsf(x), r = (a + big) - big;
    return a < big ? copysignf(r, x) : x;
}

static inline float max_(float a, float b) { return a > b ? a : b; }

/* Whether a row holds only finite values: one branch-free pass (then the loops over it need
 * no test of their own, and vectorise). */
static int row_finite(const float *x, long w) {
    uint32_t bad = 0;
    for (long i = 0; i < w; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}
static inline float min_(float a, float b) { return a < b ? a : b; }

/* fp16 <-> fp32 by bits (x86 without -mf16c would call a library routine per value).
 * Widening is exact and by integer steps alone: a float trick would pass a subnormal half
 * through a denormal float, which a thread flushing denormals (torch.set_flush_denormal)
 * reads as zero. Narrowing rounds half to even, as a cast does. */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (e == 0x1fu) {
        bits = sign | 0x7f800000u | (m << 13); /* inf, NaN (its payload) */
    } else if (e == 0 && m == 0) {
        bits = sign;
    } else {
        if (e == 0) { /* subnormal: m * 2^-24, normalised into 1.f * 2^x */
            e = 1;
            while (!(m & 0x400u)) {
                m <<= 1;
                e--; /* wraps below 0: e + 112 stays right */
            }
            m &= 0x3ffu;
        }
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f2h(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) /* past the largest half: infinity, or NaN */
        return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (u < 0x38800000u) { /* a half subnormal: let the float adder round at 2^-24 */
        float a;
        memcpy(&a, &u, 4);
        a += 0.5f;
        memcpy(&u, &a, 4);
        return sign | (uint16_t)(u - 0x3f000000u);
    }
    u += 0xc8000fffu + ((u >> 13) & 1u); /* rebias 127 -> 15 and round half to even */
    return sign | (uint16_t)(u >> 13);
}

/* A row of values as floats, and back: the dtype's branch once per row, not per value. */
static void load_row(const void *p, int dt, size_t base, float *x, long w) {
    if (dt == F32) {
        memcpy(x, (const float *)p + base, 4 * (size_t)w);
    } else if (dt == F16) {
        const uint16_t *h = (const uint16_t *)p + base;
        for (long i = 0; i < w; i++)
            x[i] = h2f(h[i]);
    } else {
        const uint16_t *h = (const uint16_t *)p + base;
        for (long i = 0; i < w; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&x[i], &u, 4);
        }
    }
}

static void store_row(void *p, int dt, size_t base, const float *x, long w) {
    if (dt == F32) {
        memcpy((float *)p + base, x, 4 * w);
    } else if (dt == F16) {
        uint16_t *h = (uint16_t *)p + base;
        for (long i = 0; i < w; i++)
            h[i] = f2h(x[i]);
    } else {
        uint16_t *h = (uint16_t *)p + base;
        for (long i = 0; i < w; i++) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            h[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                                  : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
}

/* ------------------------------------------------------------------------------ fp8-e4m3 */
static inline uint8_t e4m3(float f) { /* |f| <= 448, finite; round half to even */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(f);
    if (a < 0x1p-6f) /* subnormal: steps of 2^-9 (8 rounds up to the smallest normal) */
        return sign | (uint8_t)rne(a * 512.0f);
    uint32_t r = (u & 0x7fffffffu) - ((127u - 7u) << 23);
    r += 0x7ffffu + ((r >> 20) & 1u);
    return sign | (uint8_t)(r >> 20);
}

static void e4m3_table(void) {
    for (int i = 0; i < 256; i++) {
        int e = (i >> 3) & 15, m = i & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if (e == 15 && m == 7)
            v = NAN;
        e4m3_values[i] = (i & 0x80) ? -v : v;
    }
}

static int fp8_encode(const void *src, int dt, uint8_t *out, long n, long P, long T, long W,
                      long H) {
    long D = W / H, lb = 4 * P * H + P * T * W;
    float x[W], amax[H], s[H];
    for (long l = 0; l < n; l++) {
        uint8_t *blk = out + l * lb;
        for (long p = 0; p < P; p++) {
            size_t base = ((size_t)l * P + p) * T * W;
            for (long h = 0; h < H; h++)
                amax[h] = 0.0f;
            for (long t = 0; t < T; t++) {
                load_row(src, dt, base + t * W, x, W);
                if (!row_finite(x, W))
                    return 1;
                for (long h = 0; h < H; h++)
                    for (long d = 0; d < D; d++)
                        amax[h] = max_(amax[h], fabsf(x[h * D + d]));
            }
            for (long h = 0; h < H; h++)
                s[h] = max_(amax[h] / E4M3_MAX, TINY);
            memcpy(blk + 4 * p * H, s, 4 * H);
            uint8_t *codes = blk + 4 * P * H + p * T * W;
            for (long t = 0; t < T; t++) {
                load_row(src, dt, base + t * W, x, W);
                for (long h = 0; h < H; h++)
                    for (long d = 0; d < D; d++) {
                        float q = x[h * D + d] / s[h];
                        q = min_(max_(q, -E4M3_MAX), E4M3_MAX);
                        codes[t * W + h * D + d] = e4m3(q);
                    }
            }
        }
    }
    return 0;
}

/* A head's 256 possible values, already scaled and in the output dtype: decoding is then
 * one table read per value (the same product and rounding as computing each). */
static void fp8_table(float s, int dt, uint32_t *table) {
    float v[256];
    for (int q = 0; q < 256; q++)
        v[q] = e4m3_values[q] * s;
    if (dt == F32) {
        memcpy(table, v, sizeof v);
        return;
    }
    uint16_t h[256];
    store_row(h, dt, 0, v, 256);
    for (int q = 0; q < 256; q++)
        table[q] = h[q];
}

static int fp8_decode(const uint8_t *buf, void *out, int dt, long n, long P, long T, long W,
                      long H) {
    long D = W / H, lb = 4 * P * H + P * T * W;
    uint32_t table[H][256];
    for (long l = 0; l < n; l++) {
        const uint8_t *blk = buf + l * lb;
        for (long p = 0; p < P; p++) {
            for (long h = 0; h < H; h++) {
                float s;
                memcpy(&s, blk + 4 * (p * H + h), 4);
                fp8_table(s, dt, table[h]);
            }
            const uint8_t *codes = blk + 4 * P * H + p * T * W;
            size_t base = ((size_t)l * P + p) * T * W;
            for (long t = 0; t < T; t++) {
                const uint8_t *c = codes + t * W;
                if (dt == F32) {
                    uint32_t *o = (uint32_t *)out + base + t * W;
                    for (long h = 0; h < H; h++)
                        for (long d = 0; d < D; d++)
                            o[h * D + d] = table[h][c[h * D + d]];
                } else {
                    uint16_t *o = (uint16_t *)out + base + t * W;
                    for (long h = 0; h < H; h++)
                        for (long d = 0; d < D; d++)
                            o[h * D + d] = (uint16_t)table[h][c[h * D + d]];
                }
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------- int8 */
static int int8_encode(const void *src, int dt, uint8_t *out, long n, long P, long T, long W,
                       long H) {
    long D = W / H, lb = 4 * P * T * H + P * T * W;
    float x[W];
    for (long l = 0; l < n; l++) {
        uint8_t *blk = out + l * lb;
        for (long p = 0; p < P; p++)
            for (long t = 0; t < T; t++) {
                size_t row = (((size_t)l * P + p) * T + t) * W;
                int8_t *codes = (int8_t *)(blk + 4 * P * T * H) + (p * T + t) * W;
                load_row(src, dt, row, x, W);
                if (!row_finite(x, W))
                    return 1;
                for (long h = 0; h < H; h++) {
                    float amax = 0.0f;
                    const float *xh = x + h * D;
                    for (long d = 0; d < D; d++)
                        amax = max_(amax, fabsf(xh[d]));
                    float s = max_(amax / 127.0f, TINY);
                    memcpy(blk + 4 * ((p * T + t) * H + h), &s, 4);
                    for (long d = 0; d < D; d++) {
                        float q = rne(xh[d] / s);
                        codes[h * D + d] = (int8_t)min_(max_(q, -127.0f), 127.0f);
                    }
                }
            }
    }
    return 0;
}

static int int8_decode(const uint8_t *buf, void *out, int dt, long n, long P, long T, long W,
                       long H) {
    long D = W / H, lb = 4 * P * T * H + P * T * W;
    for (long l = 0; l < n; l++) {
        const uint8_t *blk = buf + l * lb;
        for (long p = 0; p < P; p++)
            for (long t = 0; t < T; t++) {
                float s[H];
                memcpy(s, blk + 4 * (p * T + t) * H, 4 * H);
                const int8_t *codes = (const int8_t *)(blk + 4 * P * T * H) + (p * T + t) * W;
                size_t row = (((size_t)l * P + p) * T + t) * W;
                float v[W];
                for (long h = 0; h < H; h++)
                    for (long d = 0; d < D; d++)
                        v[h * D + d] = (float)codes[h * D + d] * s[h];
                store_row(out, dt, row, v, W);
            }
    }
    return 0;
}

/* ----------------------------------------------------------------------------- int4-kivi */
static long ceil_div(long a, long b) { return (a + b - 1) / b; }

static long plane_bytes(int keys, long T, long W, long G) {
    long groups = keys ? ceil_div(T, G) * W : T * ceil_div(W, G);
    return (T * W + 1) / 2 + 4 * groups;
}

/* One group's fp16 scale and zero point from its range, as stored; 1 when out of range. */
static inline int params(float lo, float hi, uint16_t *s16, uint16_t *z16) {
    if (!isfinite(lo) || !isfinite(hi) || fabsf(lo) > FP16_LIMIT || fabsf(hi) > FP16_LIMIT)
        return 1;
    *s16 = f2h((hi - lo) / 15.0f);
    *z16 = f2h(lo);
    return 0;
}

static inline uint8_t q4(float x, float sf, float zf) {
    float q = rne((x - zf) / sf);
    return (uint8_t)min_(max_(q, 0.0f), 15.0f);
}

static inline void put4(uint8_t *codes, size_t i, uint8_t q) {
    codes[i >> 1] |= (uint8_t)(q << ((i & 1) * 4));
}

/* A row's codes into the packed run (pairs at once when the row starts on a byte). */
static void put_row4(uint8_t *codes, size_t i0, const uint8_t *q, long w) {
    if ((i0 & 1) == 0 && (w & 1) == 0) {
        uint8_t *row = codes + (i0 >> 1);
        for (long j = 0; j < w; j += 2)
            row[j >> 1] = (uint8_t)(q[j] | (q[j + 1] << 4));
    } else {
        for (long j = 0; j < w; j++)
            put4(codes, i0 + j, q[j]);
    }
}

static int int4_plane_encode(const void *src, int dt, size_t base, uint8_t *dst, int keys,
                             long T, long W, long G) {
    uint8_t *codes = dst;
    long nc = (T * W + 1) / 2, ng = keys ? W : ceil_div(W, G);
    long groups = keys ? ceil_div(T, G) * W : T * ng;
    uint8_t *sc = dst + nc, *zs = sc + 2 * groups; /* f16, unaligned: by memcpy */
    float x[W], lo[W], hi[W], sf[W], zf[W];
    uint8_t q[W];
    memset(codes, 0, nc);
    for (long t0 = 0; t0 < T; t0 += keys ? G : 1) {
        long t1 = keys ? (t0 + G < T ? t0 + G : T) : t0 + 1;
        for (long t = t0; t < t1; t++) { /* the range of each group */
            load_row(src, dt, base + t * W, x, W);
            if (!row_finite(x, W))
                return 1;
            for (long w = 0; w < W; w++) {
                if (keys) {
                    lo[w] = t == t0 ? x[w] : min_(lo[w], x[w]);
                    hi[w] = t == t0 ? x[w] : max_(hi[w], x[w]);
                } else if (w % G == 0) {
                    lo[w / G] = hi[w / G] = x[w];
                } else {
                    lo[w / G] = min_(lo[w / G], x[w]);
                    hi[w / G] = max_(hi[w / G], x[w]);
                }
            }
        }
        long row0 = keys ? (t0 / G) * W : t0 * ng;
        for (long k = 0; k < ng; k++) {
            uint16_t s16, z16;
            if (params(lo[k], hi[k], &s16, &z16))
                return 1;
            memcpy(sc + 2 * (row0 + k), &s16, 2);
            memcpy(zs + 2 * (row0 + k), &z16, 2);
            sf[k] = max_(h2f(s16), TINY);
            zf[k] = h2f(z16);
        }
        for (long t = t0; t < t1; t++) {
            load_row(src, dt, base + t * W, x, W);
            for (long w = 0; w < W; w++) {
                long k = keys ? w : w / G;
                q[w] = q4(x[w], sf[k], zf[k]);
            }
            put_row4(codes, (size_t)t * W, q, W);
        }
    }
    return 0;
}

static void int4_plane_decode(const uint8_t *blk, void *out, int dt, size_t base, int keys,
                              long T, long W, long G) {
    long nc = (T * W + 1) / 2, ng = keys ? W : ceil_div(W, G);
    long groups = keys ? ceil_div(T, G) * W : T * ng;
    const uint8_t *sc = blk + nc, *zs = sc + 2 * groups;
    float sf[W], zf[W], v[W];
    for (long t = 0; t < T; t++) {
        /* the scale and zero point of each channel of this row: per channel for keys (new
         * every G rows), per run of G channels for values */
        if (!keys || t % G == 0) {
            long row0 = keys ? (t / G) * W : t * ng;
            for (long k = 0; k < ng; k++) {
                uint16_t s16, z16;
                memcpy(&s16, sc + 2 * (row0 + k), 2);
                memcpy(&z16, zs + 2 * (row0 + k), 2);
                float a = h2f(s16), b = h2f(z16);
                if (keys) {
                    sf[k] = a;
                    zf[k] = b;
                } else {
                    long w1 = (k + 1) * G < W ? (k + 1) * G : W;
                    for (long w = k * G; w < w1; w++) {
                        sf[w] = a;
                        zf[w] = b;
                    }
                }
            }
        }
        size_t i0 = (size_t)t * W;
        if ((i0 & 1) == 0 && (W & 1) == 0) {
            const uint8_t *row = blk + (i0 >> 1);
            for (long w = 0; w < W; w += 2) {
                uint8_t b = row[w >> 1];
                float v0 = (float)(b & 15) * sf[w], v1 = (float)(b >> 4) * sf[w + 1];
                v[w] = v0 + zf[w];
                v[w + 1] = v1 + zf[w + 1];
            }
        } else {
            for (long w = 0; w < W; w++) {
                size_t i = i0 + w;
                float q = (float)((blk[i >> 1] >> ((i & 1) * 4)) & 15);
                float m = q * sf[w];
                v[w] = m + zf[w];
            }
        }
        store_row(out, dt, base + i0, v, W);
    }
}

static int int4_encode(const void *src, int dt, uint8_t *out, long n, long P, long T, long W,
                       long G) {
    long lb = 0;
    for (long p = 0; p < P; p++)
        lb += plane_bytes(P == 2 && p == 0, T, W, G);
    for (long l = 0; l < n; l++) {
        uint8_t *dst = out + l * lb;
        for (long p = 0; p < P; p++) {
            int keys = P == 2 && p == 0;
            if (int4_plane_encode(src, dt, ((size_t)l * P + p) * T * W, dst, keys, T, W, G))
                return 1;
            dst += plane_bytes(keys, T, W, G);
        }
    }
    return 0;
}

static int int4_decode(const uint8_t *buf, void *out, int dt, long n, long P, long T, long W,
                       long G) {
    long lb = 0;
    for (long p = 0; p < P; p++)
        lb += plane_bytes(P == 2 && p == 0, T, W, G);
    for (long l = 0; l < n; l++) {
        const uint8_t *blk = buf + l * lb;
        for (long p = 0; p < P; p++) {
            int keys = P == 2 && p == 0;
            int4_plane_decode(blk, out, dt, ((size_t)l * P + p) * T * W, keys, T, W, G);
            blk += plane_bytes(keys, T, W, G);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------- Python */
typedef int (*encode_fn)(const void *, int, uint8_t *, long, long, long, long, long);
typedef int (*decode_fn)(const uint8_t *, void *, int, long, long, long, long, long);

/* (src address, dtype code, out address, layers, planes, tokens, width, heads or group):
 * the caller (lmc/storage/kvcodecs/native.py) has checked every size and keeps both tensors
 * alive for the call. Returns 0, or 1: not encodable. */
static PyObject *call(PyObject *args, encode_fn enc, decode_fn dec) {
    unsigned long long a, b;
    int dt;
    long n, P, T, W, k;
    if (!PyArg_ParseTuple(args, "KiKlllll", &a, &dt, &b, &n, &P, &T, &W, &k))
        return NULL;
    if (dt < F32 || dt > BF16 || n < 1 || P < 1 || T < 1 || W < 1 || k < 1 ||
        (enc != int4_encode && dec != int4_decode && W % k != 0)) {
        PyErr_SetString(PyExc_ValueError, "bad codec call");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = enc ? enc((const void *)(uintptr_t)a, dt, (uint8_t *)(uintptr_t)b, n, P, T, W, k)
             : dec((const uint8_t *)(uintptr_t)a, (void *)(uintptr_t)b, dt, n, P, T, W, k);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

#define PAIR(name)                                                                         \
    static PyObject *py_##name##_encode(PyObject *s, PyObject *a) {                        \
        (void)s;                                                                           \
        return call(a, name##_encode, NULL);                                               \
    }                                                                                      \
    static PyObject *py_##name##_decode(PyObject *s, PyObject *a) {                        \
        (void)s;                                                                           \
        return call(a, NULL, name##_decode);                                               \
    }
PAIR(fp8)
PAIR(int8)
PAIR(int4)

static PyMethodDef methods[] = {
    {"fp8_encode", py_fp8_encode, METH_VARARGS, "fp8-e4m3 codes of a slice of layers."},
    {"fp8_decode", py_fp8_decode, METH_VARARGS, "fp8-e4m3 codes back to values."},
    {"int8_encode", py_int8_encode, METH_VARARGS, "int8 codes of a slice of layers."},
    {"int8_decode", py_int8_decode, METH_VARARGS, "int8 codes back to values."},
    {"int4_encode", py_int4_encode, METH_VARARGS, "int4-kivi codes of a slice of layers."},
    {"int4_decode", py_int4_decode, METH_VARARGS, "int4-kivi codes back to values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "lmc._kvcodecs",
                                    "CPU kernels of lmc's KV codecs.", -1, methods};

PyMODINIT_FUNC PyInit__kvcodecs(void) {
    e4m3_table();
    return PyModule_Create(&module);
}
