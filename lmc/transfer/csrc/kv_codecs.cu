// The KV codecs on the device: a chunk gathered into device memory is coded there, so what
// crosses PCIe to the pool is the coded bytes (and decoded there after a load).
//
// The layout and the arithmetic are lmc/csrc/kvcodecs.c's (and the torch path's, in
// lmc/storage/kvcodecs/), bit for bit: fp32 arithmetic in the same order, no fused
// multiply-adds (compiled with --fmad=false), round-half-even, fp16/bf16/e4m3 converted by
// bits. Every helper is __host__ __device__ and a thread's work depends only on its index,
// never on another thread's (no shared memory, no __syncthreads): a range reduction that
// spans threads is a kernel of its own (fp8's per-head amax: rows first, then heads).
// tests/transfer/test_kv_codecs_cu.py compiles this file with a plain C++ compiler and runs
// every __global__ entry point thread by thread on the CPU against the torch path; the
// device run is marked gpu. No headers are included, so NVRTC (CuPy) compiles it as is.
//
// Arguments: src/dst chunk [n layers][P planes][T tokens][W width] of dtype dt (0 f32,
// 1 f16, 2 bf16); codes: n layer blocks of the codec's layer bytes (see the C file).

typedef unsigned char lmc_u8;
typedef unsigned short lmc_u16;
typedef unsigned int lmc_u32;
typedef long long lmc_i64;

#define LMC_TINY 7.88860905221011805411728565283e-31f  // 2^-100
#define LMC_E4M3_MAX 448.0f
#define LMC_FP16_LIMIT 60000.0f

__host__ __device__ __forceinline__ float lmc_bits_f(lmc_u32 u) {
    union { lmc_u32 u; float f; } c;
    c.u = u;
    return c.f;
}

__host__ __device__ __forceinline__ lmc_u32 lmc_f_bits(float f) {
    union { lmc_u32 u; float f; } c;
    c.f = f;
    return c.u;
}

__host__ __device__ __forceinline__ bool lmc_finite(float f) {
    return (lmc_f_bits(f) & 0x7f800000u) != 0x7f800000u;
}

// by integer steps alone: a float trick (h's bits times 2^112) passes a subnormal half
// through a denormal float, which a device that flushes denormals (FTZ/DAZ) reads as zero
__host__ __device__ __forceinline__ float lmc_h2f(lmc_u16 h) {
    lmc_u32 sign = (lmc_u32)(h & 0x8000u) << 16;
    lmc_u32 e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return lmc_bits_f(sign | 0x7f800000u | (m << 13));  // inf, NaN (payload)
    if (e == 0) {
        if (m == 0) return lmc_bits_f(sign);
        e = 1;  // subnormal: m * 2^-24, normalised into a float's 1.f * 2^x
        while (!(m & 0x400u)) { m <<= 1; e--; }  // e may wrap below 0: 112 + e stays right
        m &= 0x3ffu;
    }
    return lmc_bits_f(sign | ((e + 112u) << 23) | (m << 13));
}

__host__ __device__ __forceinline__ lmc_u16 lmc_f2h(float f) {
    lmc_u32 u = lmc_f_bits(f);
    lmc_u16 sign = (lmc_u16)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (u < 0x38800000u) return sign | (lmc_u16)(lmc_f_bits(lmc_bits_f(u) + 0.5f) - 0x3f000000u);
    u += 0xc8000fffu + ((u >> 13) & 1u);
    return sign | (lmc_u16)(u >> 13);
}

__host__ __device__ __forceinline__ float lmc_rint(float x) {  // round half to even
    const float big = 8388608.0f;                             // 2^23
    float a = x < 0 ? -x : x;
    if (!(a < big)) return x;
    float r = (a + big) - big;  // the adder rounds half to even at integer precision
    return x < 0 ? -r : r;
}

__host__ __device__ __forceinline__ float lmc_load(const void* p, int dt, lmc_i64 i) {
    if (dt == 0) return ((const float*)p)[i];
    lmc_u16 h = ((const lmc_u16*)p)[i];
    return dt == 1 ? lmc_h2f(h) : lmc_bits_f((lmc_u32)h << 16);
}

__host__ __device__ __forceinline__ void lmc_store(void* p, int dt, lmc_i64 i, float v) {
    if (dt == 0) { ((float*)p)[i] = v; return; }
    if (dt == 1) { ((lmc_u16*)p)[i] = lmc_f2h(v); return; }
    lmc_u32 u = lmc_f_bits(v);
    ((lmc_u16*)p)[i] = (u & 0x7fffffffu) > 0x7f800000u
                           ? (lmc_u16)((u >> 16) | 0x40)
                           : (lmc_u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__host__ __device__ __forceinline__ float lmc_fmaxf(float a, float b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ float lmc_fminf(float a, float b) { return a < b ? a : b; }

__host__ __device__ __forceinline__ lmc_u8 lmc_e4m3(float f) {  // |f| <= 448, finite
    lmc_u32 u = lmc_f_bits(f);
    lmc_u8 sign = (lmc_u8)((u >> 24) & 0x80);
    lmc_u32 a = u & 0x7fffffffu;
    if (a < 0x3c800000u)  // below 2^-6: steps of 2^-9
        return sign | (lmc_u8)lmc_rint(lmc_bits_f(a) * 512.0f);
    lmc_u32 r = a - ((127u - 7u) << 23);
    r += 0x7ffffu + ((r >> 20) & 1u);
    return sign | (lmc_u8)(r >> 20);
}

__host__ __device__ __forceinline__ float lmc_e4m3_value(lmc_u8 q) {
    int e = (q >> 3) & 15, m = q & 7;
    float v = e == 0 ? (float)m * 0.001953125f  // m * 2^-9
                     : lmc_bits_f((lmc_u32)(e + 120) << 23) * (1.0f + (float)m * 0.125f);
    return (q & 0x80) ? -v : v;
}

__host__ __device__ __forceinline__ lmc_i64 lmc_tid() {
    return (lmc_i64)blockIdx.x * blockDim.x + threadIdx.x;
}

__host__ __device__ __forceinline__ lmc_i64 lmc_nthreads() {
    return (lmc_i64)gridDim.x * blockDim.x;
}

// ----------------------------------------------------------------------------- fp8-e4m3
// 1. per (layer, plane, token, head) row: the row's amax into rowmax; a non-finite value sets
//    *bad. 2. per (layer, plane, head): the scale = max(amax over tokens) / 448, into the
//    codes. 3. per value: its code.
extern "C" __global__ void lmc_fp8_rowmax(const void* src, int dt, float* rowmax, int* bad,
                                          lmc_i64 n, lmc_i64 P, lmc_i64 T, lmc_i64 W,
                                          lmc_i64 H) {
    lmc_i64 D = W / H, rows = n * P * T * H;
    for (lmc_i64 r = lmc_tid(); r < rows; r += lmc_nthreads()) {
        lmc_i64 h = r % H, row = r / H;  // row = (l, p, t)
        float m = 0.0f;
        for (lmc_i64 d = 0; d < D; d++) {
            float v = lmc_load(src, dt, row * W + h * D + d);
            if (!lmc_finite(v)) *bad = 1;
            m = lmc_fmaxf(m, v < 0 ? -v : v);
        }
        rowmax[r] = m;
    }
}

extern "C" __global__ void lmc_fp8_scales(const float* rowmax, lmc_u8* codes, lmc_i64 n,
                                          lmc_i64 P, lmc_i64 T, lmc_i64 W, lmc_i64 H) {
    lmc_i64 lb = 4 * P * H + P * T * W;
    for (lmc_i64 g = lmc_tid(); g < n * P * H; g += lmc_nthreads()) {
        lmc_i64 h = g % H, lp = g / H, l = lp / P, p = lp % P;
        float m = 0.0f;
        for (lmc_i64 t = 0; t < T; t++) m = lmc_fmaxf(m, rowmax[(lp * T + t) * H + h]);
        float s = lmc_fmaxf(m / LMC_E4M3_MAX, LMC_TINY);
        lmc_u32 b = lmc_f_bits(s);
        lmc_u8* at = codes + l * lb + 4 * (p * H + h);
        for (int k = 0; k < 4; k++) at[k] = (lmc_u8)(b >> (8 * k));
    }
}

__host__ __device__ __forceinline__ float lmc_scale_at(const lmc_u8* at) {
    return lmc_bits_f((lmc_u32)at[0] | ((lmc_u32)at[1] << 8) | ((lmc_u32)at[2] << 16) |
                      ((lmc_u32)at[3] << 24));
}

extern "C" __global__ void lmc_fp8_encode(const void* src, int dt, lmc_u8* codes, lmc_i64 n,
                                          lmc_i64 P, lmc_i64 T, lmc_i64 W, lmc_i64 H) {
    lmc_i64 D = W / H, lb = 4 * P * H + P * T * W, total = n * P * T * W;
    for (lmc_i64 i = lmc_tid(); i < total; i += lmc_nthreads()) {
        lmc_i64 w = i % W, t = (i / W) % T, lp = i / (W * T), l = lp / P, p = lp % P;
        float s = lmc_scale_at(codes + l * lb + 4 * (p * H + w / D));
        float q = lmc_load(src, dt, i) / s;
        q = lmc_fminf(lmc_fmaxf(q, -LMC_E4M3_MAX), LMC_E4M3_MAX);
        codes[l * lb + 4 * P * H + (p * T + t) * W + w] = lmc_e4m3(q);
    }
}

extern "C" __global__ void lmc_fp8_decode(const lmc_u8* codes, void* dst, int dt, lmc_i64 n,
                                          lmc_i64 P, lmc_i64 T, lmc_i64 W, lmc_i64 H) {
    lmc_i64 D = W / H, lb = 4 * P * H + P * T * W, total = n * P * T * W;
    for (lmc_i64 i = lmc_tid(); i < total; i += lmc_nthreads()) {
        lmc_i64 w = i % W, t = (i / W) % T, lp = i / (W * T), l = lp / P, p = lp % P;
        float s = lmc_scale_at(codes + l * lb + 4 * (p * H + w / D));
        lmc_u8 q = codes[l * lb + 4 * P * H + (p * T + t) * W + w];
        lmc_store(dst, dt, i, lmc_e4m3_value(q) * s);
    }
}

// --------------------------------------------------------------------------------- int8
// One thread per (layer, plane, token, head): its range, scale and codes.
extern "C" __global__ void lmc_int8_encode(const void* src, int dt, lmc_u8* codes, int* bad,
                                           lmc_i64 n, lmc_i64 P, lmc_i64 T, lmc_i64 W,
                                           lmc_i64 H) {
    lmc_i64 D = W / H, lb = 4 * P * T * H + P * T * W, groups = n * P * T * H;
    for (lmc_i64 g = lmc_tid(); g < groups; g += lmc_nthreads()) {
        lmc_i64 h = g % H, row = g / H, l = row / (P * T), pt = row % (P * T);
        float m = 0.0f;
        for (lmc_i64 d = 0; d < D; d++) {
            float v = lmc_load(src, dt, row * W + h * D + d);
            if (!lmc_finite(v)) *bad = 1;
            m = lmc_fmaxf(m, v < 0 ? -v : v);
        }
        float s = lmc_fmaxf(m / 127.0f, LMC_TINY);
        lmc_u32 b = lmc_f_bits(s);
        lmc_u8* blk = codes + l * lb;
        for (int k = 0; k < 4; k++) blk[4 * (pt * H + h) + k] = (lmc_u8)(b >> (8 * k));
        for (lmc_i64 d = 0; d < D; d++) {
            float q = lmc_rint(lmc_load(src, dt, row * W + h * D + d) / s);
            q = lmc_fminf(lmc_fmaxf(q, -127.0f), 127.0f);
            blk[4 * P * T * H + pt * W + h * D + d] = (lmc_u8)(signed char)q;
        }
    }
}

extern "C" __global__ void lmc_int8_decode(const lmc_u8* codes, void* dst, int dt, lmc_i64 n,
                                           lmc_i64 P, lmc_i64 T, lmc_i64 W, lmc_i64 H) {
    lmc_i64 D = W / H, lb = 4 * P * T * H + P * T * W, total = n * P * T * W;
    for (lmc_i64 i = lmc_tid(); i < total; i += lmc_nthreads()) {
        lmc_i64 w = i % W, pt = (i / W) % (P * T), l = i / (W * P * T);
        const lmc_u8* blk = codes + l * lb;
        float s = lmc_scale_at(blk + 4 * (pt * H + w / D));
        float q = (float)(signed char)blk[4 * P * T * H + pt * W + w];
        lmc_store(dst, dt, i, q * s);
    }
}

// ---------------------------------------------------------------------------- int4-kivi
__host__ __device__ __forceinline__ lmc_i64 lmc_cdiv(lmc_i64 a, lmc_i64 b) {
    return (a + b - 1) / b;
}

__host__ __device__ __forceinline__ lmc_i64 lmc_plane_bytes(int keys, lmc_i64 T, lmc_i64 W,
                                                           lmc_i64 G) {
    lmc_i64 groups = keys ? lmc_cdiv(T, G) * W : T * lmc_cdiv(W, G);
    return (T * W + 1) / 2 + 4 * groups;
}

// Where plane p of layer l starts in the codes, and whether it is grouped as keys.
__host__ __device__ __forceinline__ lmc_i64 lmc_plane_at(lmc_i64 l, lmc_i64 p, lmc_i64 P,
                                                        lmc_i64 T, lmc_i64 W, lmc_i64 G) {
    lmc_i64 lb = 0, at = 0;
    for (lmc_i64 q = 0; q < P; q++) {
        lmc_i64 b = lmc_plane_bytes(P == 2 && q == 0, T, W, G);
        if (q < p) at += b;
        lb += b;
    }
    return l * lb + at;
}

// One thread per group: (token group, channel) of keys, (token, channel group) of values.
// Codes are written a byte at a time by the thread owning both of its nibbles: a group of an
// odd width would share a byte with its neighbour, so such groups are written by the
// decode-order pass below (lmc_int4_pack) instead.
extern "C" __global__ void lmc_int4_params(const void* src, int dt, lmc_u8* codes, int* bad,
                                           lmc_i64 n, lmc_i64 P, lmc_i64 T, lmc_i64 W,
                                           lmc_i64 G) {
    lmc_i64 per_layer = 0;
    for (lmc_i64 p = 0; p < P; p++) {
        int keys = P == 2 && p == 0;
        per_layer += keys ? lmc_cdiv(T, G) * W : T * lmc_cdiv(W, G);
    }
    for (lmc_i64 g = lmc_tid(); g < n * per_layer; g += lmc_nthreads()) {
        lmc_i64 l = g / per_layer, k = g % per_layer, p = 0;
        int keys = P == 2;
        lmc_i64 first = keys ? lmc_cdiv(T, G) * W : T * lmc_cdiv(W, G);
        if (P == 2 && k >= first) { p = 1; k -= first; keys = 0; }
        if (P == 1) { p = 0; keys = 0; }
        lmc_i64 ng = keys ? W : lmc_cdiv(W, G), groups = keys ? lmc_cdiv(T, G) * W : T * ng;
        lmc_i64 r = k / ng, c = k % ng;  // keys: (token group, channel); values: (token, group)
        lmc_i64 t0 = keys ? r * G : r, t1 = keys ? (t0 + G < T ? t0 + G : T) : r + 1;
        lmc_i64 w0 = keys ? c : c * G, w1 = keys ? c + 1 : (w0 + G < W ? w0 + G : W);
        lmc_i64 base = (l * P + p) * T * W;
        float lo = lmc_load(src, dt, base + t0 * W + w0), hi = lo;
        for (lmc_i64 t = t0; t < t1; t++)
            for (lmc_i64 w = w0; w < w1; w++) {
                float v = lmc_load(src, dt, base + t * W + w);
                if (!lmc_finite(v)) *bad = 1;
                lo = lmc_fminf(lo, v);
                hi = lmc_fmaxf(hi, v);
            }
        if (!lmc_finite(lo) || !lmc_finite(hi) || lo < -LMC_FP16_LIMIT || lo > LMC_FP16_LIMIT ||
            hi < -LMC_FP16_LIMIT || hi > LMC_FP16_LIMIT) {
            *bad = 1;
            continue;
        }
        lmc_u16 s16 = lmc_f2h((hi - lo) / 15.0f), z16 = lmc_f2h(lo);
        lmc_u8* plane = codes + lmc_plane_at(l, p, P, T, W, G);
        lmc_u8* sc = plane + (T * W + 1) / 2;
        lmc_u8* zs = sc + 2 * groups;
        sc[2 * k] = (lmc_u8)s16;
        sc[2 * k + 1] = (lmc_u8)(s16 >> 8);
        zs[2 * k] = (lmc_u8)z16;
        zs[2 * k + 1] = (lmc_u8)(z16 >> 8);
    }
}

__host__ __device__ __forceinline__ void lmc_group_of(lmc_i64 t, lmc_i64 w, int keys, lmc_i64 T,
                                                      lmc_i64 W, lmc_i64 G, lmc_i64* k) {
    *k = keys ? (t / G) * W + w : t * lmc_cdiv(W, G) + w / G;
}

__host__ __device__ __forceinline__ float lmc_h2f_at(const lmc_u8* at) {
    return lmc_h2f((lmc_u16)(at[0] | (at[1] << 8)));
}

// One thread per code byte (two values): each byte is written by one thread only.
extern "C" __global__ void lmc_int4_pack(const void* src, int dt, lmc_u8* codes, lmc_i64 n,
                                         lmc_i64 P, lmc_i64 T, lmc_i64 W, lmc_i64 G) {
    lmc_i64 nb = (T * W + 1) / 2, total = n * P * nb;
    for (lmc_i64 j = lmc_tid(); j < total; j += lmc_nthreads()) {
        lmc_i64 b = j % nb, lp = j / nb, l = lp / P, p = lp % P;
        int keys = P == 2 && p == 0;
        lmc_i64 groups = keys ? lmc_cdiv(T, G) * W : T * lmc_cdiv(W, G);
        lmc_u8* plane = codes + lmc_plane_at(l, p, P, T, W, G);
        const lmc_u8* sc = plane + nb;
        const lmc_u8* zs = sc + 2 * groups;
        lmc_u8 byte = 0;
        for (int half = 0; half < 2; half++) {
            lmc_i64 i = 2 * b + half;
            if (i >= T * W) break;
            lmc_i64 t = i / W, w = i % W, k;
            lmc_group_of(t, w, keys, T, W, G, &k);
            float sf = lmc_fmaxf(lmc_h2f_at(sc + 2 * k), LMC_TINY), zf = lmc_h2f_at(zs + 2 * k);
            float x = lmc_load(src, dt, (l * P + p) * T * W + i);
            float q = lmc_rint((x - zf) / sf);
            q = lmc_fminf(lmc_fmaxf(q, 0.0f), 15.0f);
            byte |= (lmc_u8)((lmc_u8)q << (4 * half));
        }
        plane[b] = byte;
    }
}

extern "C" __global__ void lmc_int4_decode(const lmc_u8* codes, void* dst, int dt, lmc_i64 n,
                                           lmc_i64 P, lmc_i64 T, lmc_i64 W, lmc_i64 G) {
    lmc_i64 total = n * P * T * W, nb = (T * W + 1) / 2;
    for (lmc_i64 i = lmc_tid(); i < total; i += lmc_nthreads()) {
        lmc_i64 e = i % (T * W), lp = i / (T * W), l = lp / P, p = lp % P;
        int keys = P == 2 && p == 0;
        lmc_i64 groups = keys ? lmc_cdiv(T, G) * W : T * lmc_cdiv(W, G), k;
        const lmc_u8* plane = codes + lmc_plane_at(l, p, P, T, W, G);
        lmc_group_of(e / W, e % W, keys, T, W, G, &k);
        const lmc_u8* sc = plane + nb;
        float q = (float)((plane[e >> 1] >> (4 * (e & 1))) & 15);
        float m = q * lmc_h2f_at(sc + 2 * k);
        lmc_store(dst, dt, i, m + lmc_h2f_at(sc + 2 * groups + 2 * k));
    }
}
