// Gather / scatter of KV rows between an engine's paged cache and lmc chunk buffers.
//
// Semantics are those of lmc/transfer/torch_copy.py (TorchTransfer), bit for bit: the kernels move bytes,
// never values, so one kernel serves fp32/fp16/bf16/fp8 alike.
//
// A *row* is what one token holds in one plane (K, V or the MLA latent) of one layer:
// heads*dim elements. Chunk buffers store rows contiguously as [layers, planes, tokens, row];
// in the cache a row starts at
//     cache_ptr[layer][plane] + (slot / block_size) * blk + (slot % block_size) * off    (bytes)
// and is made of segments that are contiguous in both places: the whole row (vLLM flash /
// flashinfer / MLA, SGLang), one head (vLLM 0.32 GPU layouts, where K and V alternate per
// head; V of the vLLM CPU layout) or one element (K of the vLLM CPU layout, which is
// transposed inside a block). Segment k starts at element e = k*seg_elems,
// i.e. at head e / head_size, dim e % head_size: offset  head * head_b + dim * dim_b.
//
// One launch moves every (token, selected layer, plane) row of every chunk of a call. Work is
// split into groups of `lanes` threads (a power of two <= 32, so a group never straddles a warp);
// a group copies one row with vector loads/stores of V bytes, then strides over the grid. Rows
// are numbered (layer, plane, token) with the token fastest, so neighbouring groups write
// neighbouring rows of the same chunk: wide, sequential bursts, which matters most when the
// destination is pinned host memory reached over PCIe.
//
// Every helper is __host__ __device__ and a thread's work depends only on (tid, nthreads), never
// on other threads: tests/core/test_cuda_sources.py compiles this file with a plain C++
// compiler and runs the __global__ entry points thread by thread on the CPU, in several
// orders, checking the bounds and alignment of every vector access (LMC_LOAD / LMC_STORE) and
// the result against a reference written from each layout's definition. No headers are
// included, so NVRTC (CuPy) compiles it as is.

typedef long long lmc_i64;
typedef unsigned long long lmc_u64;

// Per-plane geometry in the call table, LMC_GEOM values per plane (byte strides except [4]):
//   [0] blk: bytes between blocks        [1] off: bytes between slots of a block
//   [2] head_b: bytes between heads      [3] dim_b: bytes between dims of a head
//   [4] seg_elems: elements per segment  [5] seg_bytes: bytes per segment
#define LMC_GEOM 6
#define LMC_THREADS 256  // threads per block; lmc/transfer/cuda_copy.py launches with the same number

// Every access to KV cache or chunk memory goes through these two macros: plain dereferences
// here, a bounds/alignment-checking translation in the host emulation (which defines them
// before including this file).
#ifndef LMC_LOAD
#define LMC_LOAD(ptr) (*(ptr))
#define LMC_STORE(ptr, val) (*(ptr) = (val))
#endif

// The one kernel argument, passed by value (mirrored by a ctypes.Structure in Python).
struct KVCopyArgs {
  const lmc_i64* tokens;  // [2][n_tokens]: slot (< 0: skip), then (chunk << 32) | row in chunk
  const lmc_i64* table;   // geom[n_planes][LMC_GEOM], cache[n_layers][n_planes],
                          // buf[n_chunks][n_layers][n_planes] (device addresses)
  lmc_i64 n_tokens;
  lmc_i64 block_size;
  int n_layers;   // layers moved by this call (the table holds only those)
  int n_planes;   // 2 (K, V) or 1 (MLA)
  int head_size;  // elements per head
  int row_bytes;  // bytes of one row: heads * head_size * element size
  int lanes;      // threads per row group: power of two, 1..32
  int reserved;
};

template <int W> struct LmcVec;
template <> struct LmcVec<16> { typedef uint4 T; };
template <> struct LmcVec<8> { typedef uint2 T; };
template <> struct LmcVec<4> { typedef unsigned int T; };
template <> struct LmcVec<2> { typedef unsigned short T; };
template <> struct LmcVec<1> { typedef unsigned char T; };

// Whole row contiguous on both sides: four independent loads in flight per thread before any
// store, which keeps enough reads outstanding when the source is host memory (scatter, direct).
template <typename T>
__host__ __device__ __forceinline__ void lmc_copy_contiguous(T* dst, const T* src, int vecs,
                                                             int lane, int lanes) {
  int v = lane;
  for (; v + 3 * lanes < vecs; v += 4 * lanes) {
    const T a = LMC_LOAD(src + v);
    const T b = LMC_LOAD(src + v + lanes);
    const T c = LMC_LOAD(src + v + 2 * lanes);
    const T d = LMC_LOAD(src + v + 3 * lanes);
    LMC_STORE(dst + v, a);
    LMC_STORE(dst + v + lanes, b);
    LMC_STORE(dst + v + 2 * lanes, c);
    LMC_STORE(dst + v + 3 * lanes, d);
  }
  for (; v < vecs; v += lanes) LMC_STORE(dst + v, LMC_LOAD(src + v));
}

// Row made of segments scattered in the cache (vLLM GPU's K/V interleaved per head, vLLM CPU's
// transposed K): one vector at a time. The
// host picks sizeof(T) so that it divides seg_bytes and every stride, so a vector never
// crosses a segment.
template <typename T, bool TO_CACHE>
__host__ __device__ __forceinline__ void lmc_copy_segmented(char* cache, char* buf,
                                                            const lmc_i64* g, int head_size,
                                                            int row_bytes, int lane, int lanes) {
  const lmc_i64 head_b = g[2];
  const lmc_i64 dim_b = g[3];
  const int seg_elems = (int)g[4];
  const int seg_bytes = (int)g[5];
  for (int o = lane * (int)sizeof(T); o < row_bytes; o += lanes * (int)sizeof(T)) {
    const int k = o / seg_bytes;
    const int within = o - k * seg_bytes;
    const int e0 = k * seg_elems;
    const int h = e0 / head_size;
    const int d = e0 - h * head_size;
    char* c = cache + h * head_b + d * dim_b + within;
    if (TO_CACHE) {
      LMC_STORE(reinterpret_cast<T*>(c), LMC_LOAD(reinterpret_cast<const T*>(buf + o)));
    } else {
      LMC_STORE(reinterpret_cast<T*>(buf + o), LMC_LOAD(reinterpret_cast<const T*>(c)));
    }
  }
}

// q = a / b, *rem = a % b for a >= 0, b > 0. Index math runs once per row and all of it fits in
// 32 bits in practice; the 32-bit hardware path is several times cheaper than 64-bit division.
__host__ __device__ __forceinline__ lmc_i64 lmc_divmod(lmc_i64 a, lmc_i64 b, lmc_i64* rem) {
  if (((lmc_u64)a | (lmc_u64)b) <= 0xffffffffULL) {
    const unsigned q = (unsigned)a / (unsigned)b;
    *rem = (lmc_i64)((unsigned)a - q * (unsigned)b);
    return (lmc_i64)q;
  }
  const lmc_i64 q = a / b;
  *rem = a - q * b;
  return q;
}

// The work of thread `tid` out of `nthreads` (a multiple of a.lanes).
// TO_CACHE = false: gather (cache -> chunk buffers); true: scatter (chunk buffers -> cache).
template <typename T, bool TO_CACHE>
__host__ __device__ inline void lmc_kv_copy_thread(const KVCopyArgs& a, lmc_i64 tid,
                                                   lmc_i64 nthreads) {
  const int P = a.n_planes;
  const lmc_i64 rows = a.n_tokens * a.n_layers * P;
  const lmc_i64* geom = a.table;
  const lmc_i64* cache_ptr = geom + P * LMC_GEOM;
  const lmc_i64* buf_ptr = cache_ptr + (lmc_i64)a.n_layers * P;
  const int vecs = a.row_bytes / (int)sizeof(T);
  const int lane = (int)(tid % a.lanes);
  const lmc_i64 groups = nthreads / a.lanes;
  for (lmc_i64 row = tid / a.lanes; row < rows; row += groups) {
    lmc_i64 t, p, in_blk;
    const lmc_i64 lp = lmc_divmod(row, a.n_tokens, &t);
    const lmc_i64 li = lmc_divmod(lp, P, &p);
    const lmc_i64 slot = a.tokens[t];
    if (slot < 0) continue;  // padding / not-to-be-moved token
    const lmc_i64 code = a.tokens[a.n_tokens + t];
    const lmc_i64 chunk = code >> 32;
    const lmc_i64 r = code & 0xffffffffLL;
    const lmc_i64* g = geom + p * LMC_GEOM;
    const lmc_i64 blk = lmc_divmod(slot, a.block_size, &in_blk);
    char* cache = reinterpret_cast<char*>((lmc_u64)cache_ptr[li * P + p]) + blk * g[0] +
                  in_blk * g[1];
    char* buf = reinterpret_cast<char*>((lmc_u64)buf_ptr[(chunk * a.n_layers + li) * P + p]) +
                r * a.row_bytes;
    if (g[5] == a.row_bytes) {
      if (TO_CACHE) {
        lmc_copy_contiguous<T>(reinterpret_cast<T*>(cache), reinterpret_cast<const T*>(buf), vecs,
                               lane, a.lanes);
      } else {
        lmc_copy_contiguous<T>(reinterpret_cast<T*>(buf), reinterpret_cast<const T*>(cache), vecs,
                               lane, a.lanes);
      }
    } else {
      lmc_copy_segmented<T, TO_CACHE>(cache, buf, g, a.head_size, a.row_bytes, lane, a.lanes);
    }
  }
}

#define LMC_TID ((lmc_i64)blockIdx.x * blockDim.x + threadIdx.x)
#define LMC_NTHREADS ((lmc_i64)gridDim.x * blockDim.x)

// Entry points: lmc_kv_{gather,scatter}_v{vector bytes}. The wrapper picks the widest vector
// that every address and stride of the call is aligned to.
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_gather_v16(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<16>::T, false>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_gather_v8(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<8>::T, false>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_gather_v4(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<4>::T, false>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_gather_v2(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<2>::T, false>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_gather_v1(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<1>::T, false>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_scatter_v16(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<16>::T, true>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_scatter_v8(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<8>::T, true>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_scatter_v4(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<4>::T, true>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_scatter_v2(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<2>::T, true>(a, LMC_TID, LMC_NTHREADS);
}
extern "C" __global__ void __launch_bounds__(LMC_THREADS) lmc_kv_scatter_v1(const KVCopyArgs a) {
  lmc_kv_copy_thread<LmcVec<1>::T, true>(a, LMC_TID, LMC_NTHREADS);
}
