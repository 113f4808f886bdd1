// kvtier gather/scatter between an engine's paged KV cache and kvtier blocks.
//
// A kvtier block is [layer][kv][token][head][row] bytes, contiguous, where a row is
// one head's head_size elements. Each engine layer cache is described by byte
// strides of its canonical view [page][kv][token][head][row] (see layouts.py), so one
// kernel serves every page format (NHD, HND, vLLM CPU, packed K|V, MLA) and every
// element type: it only moves bytes.
//
// One launch covers all layers and all blocks of a call. CTA x = one chunk: a
// (block, layer, kv, chunk-of-page) tuple of chunk_tokens * num_heads rows. Layer
// base pointers and per-block destination pointers come in device arrays, so the
// kvtier side may be device memory or CUDA-registered (mapped) host memory.
//
// VEC is the copy width in bytes (16, 8, 4, 2, 1); the host picks the widest one that
// divides the row and every pointer and stride, so 16-byte vectors are the norm and
// odd geometries still copy correctly. Self-contained: compiles with NVRTC (no
// headers) and with nvcc -cubin.

typedef unsigned long long u64;
typedef long long i64;

template <int VEC> struct VecType;
template <> struct VecType<16> { typedef uint4 T; };
template <> struct VecType<8> { typedef uint2 T; };
template <> struct VecType<4> { typedef unsigned int T; };
template <> struct VecType<2> { typedef unsigned short T; };
template <> struct VecType<1> { typedef unsigned char T; };

struct ChunkArgs {
  const u64* layer_ptrs;    // [num_layers] engine layer cache base addresses
  const u64* block_ptrs;    // [n_blocks] kvtier block base addresses
  const i64* chunk_pages;   // [n_blocks * chunks_per_block] engine page per chunk
  const i64* chunk_subs;    // [n_blocks * chunks_per_block] slice of the page
  int num_layers;
  int num_kv;
  int chunks_per_block;
  int chunk_tokens;
  int num_heads;
  int row_bytes;
  i64 page_stride;          // engine byte strides of the canonical view
  i64 kv_stride;
  i64 token_stride;
  i64 head_stride;
};

// Copy one chunk: chunk_tokens x num_heads rows between engine page and kvtier block.
template <int VEC, bool GATHER>
__device__ __forceinline__ void copy_chunk(const ChunkArgs& a, long long chunk) {
  typedef typename VecType<VEC>::T V;
  // chunk = ((block * num_layers + layer) * num_kv + kv) * chunks_per_block + c
  const int c = (int)(chunk % a.chunks_per_block);
  long long rest = chunk / a.chunks_per_block;
  const int kv = (int)(rest % a.num_kv);
  rest /= a.num_kv;
  const int layer = (int)(rest % a.num_layers);
  const long long block = rest / a.num_layers;

  const long long map = block * a.chunks_per_block + c;
  const i64 page = a.chunk_pages[map];
  const i64 sub = a.chunk_subs[map];

  unsigned char* engine = (unsigned char*)a.layer_ptrs[layer] + page * a.page_stride +
                          sub * (i64)a.chunk_tokens * a.token_stride + kv * a.kv_stride;
  const i64 block_tokens = (i64)a.chunks_per_block * a.chunk_tokens;
  const i64 row_run = (i64)a.num_heads * a.row_bytes;
  unsigned char* kvt = (unsigned char*)a.block_ptrs[block] +
                       ((i64)(layer * a.num_kv + kv) * block_tokens +
                        (i64)c * a.chunk_tokens) * row_run;

  const int vecs_per_row = a.row_bytes / VEC;
  const int items = a.chunk_tokens * a.num_heads * vecs_per_row;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const int v = i % vecs_per_row;
    const int th = i / vecs_per_row;  // token * num_heads + head, kvtier row order
    const int head = th % a.num_heads;
    const int token = th / a.num_heads;
    V* e = (V*)(engine + token * a.token_stride + head * a.head_stride) + v;
    V* k = (V*)(kvt + (i64)th * a.row_bytes) + v;
    if (GATHER) {
      *k = *e;
    } else {
      *e = *k;
    }
  }
}

template <int VEC, bool GATHER>
__device__ __forceinline__ void run(const ChunkArgs& a, long long total_chunks) {
  for (long long chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    copy_chunk<VEC, GATHER>(a, chunk);
  }
}

// Flat parameter list (no struct by value) so any launcher can pass plain scalars.
#define KVTIER_PARAMS                                                                \
  const u64 *layer_ptrs, const u64 *block_ptrs, const i64 *chunk_pages,              \
      const i64 *chunk_subs, int num_layers, int num_kv, int chunks_per_block,       \
      int chunk_tokens, int num_heads, int row_bytes, i64 page_stride,               \
      i64 kv_stride, i64 token_stride, i64 head_stride, long long total
#define KVTIER_ARGS                                                                  \
  ChunkArgs a = {layer_ptrs,   block_ptrs,   chunk_pages, chunk_subs, num_layers,     \
                 num_kv,       chunks_per_block, chunk_tokens, num_heads, row_bytes,  \
                 page_stride,  kv_stride,    token_stride, head_stride}

#define KVTIER_KERNELS(VEC)                                                          \
  extern "C" __global__ void kvtier_gather_v##VEC(KVTIER_PARAMS) {                   \
    KVTIER_ARGS;                                                                     \
    run<VEC, true>(a, total);                                                        \
  }                                                                                  \
  extern "C" __global__ void kvtier_scatter_v##VEC(KVTIER_PARAMS) {                  \
    KVTIER_ARGS;                                                                     \
    run<VEC, false>(a, total);                                                       \
  }

KVTIER_KERNELS(16)
KVTIER_KERNELS(8)
KVTIER_KERNELS(4)
KVTIER_KERNELS(2)
KVTIER_KERNELS(1)
