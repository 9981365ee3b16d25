/* The small fp32 operations of a CPU decode step, each one call from Python instead of several
 * ATen ops: residual add + RMSNorm, rotary of q and k plus the K/V cache write, SiLU-and-multiply,
 * and decode attention read in place from the paged cache; the GEMV of a few rows and the greedy
 * LM head; and every dense layer of a small decode step in one call.
 *
 * Why: at batch 1 a SmolLM2 step ran 1,144 ATen ops, and on an Intel Xeon with AMX (2 vCPUs,
 * torch 2.13) the time between its 121 matmuls was 17 ms of a 41 ms step; ATen's fp32 rms_norm
 * alone took 13 us standalone and ~65 us after a matmul. These loops are short and plain: gcc
 * -O3 -march=native vectorizes them for the CPU it builds on (AVX2, AVX-512).
 *
 * Numerics: the same formulas as kvbatch/kernels/reference.py, computed in fp32; sums and the
 * exponential are ordered and rounded differently from ATen's (not bit for bit; the tests bound
 * the difference). exp is a Cephes-style polynomial (below ~2 ulp over the range used), so that
 * the loops vectorize without libm calls.
 *
 * Every index read from a tensor (positions, slots, block ids, context lengths) is checked
 * against the bounds passed in; a bad one returns a nonzero code and writes nothing past a
 * buffer. Threads: OpenMP where a call carries enough work, on the libgomp torch has loaded.
 *
 * The source is split by concern into the files included below, compiled as this one translation
 * unit (one library, and the compiler inlines across the parts as within one file: where a row
 * function is inlined, or not, decides how its sums vectorize, and so the bits). Each part uses
 * what native_common.h and the parts before it define:
 *   native_common.h         headers, status codes, limits, the vector macros, exp, bf16 <-> fp32, the team helper
 *   native_small_ops.c      residual add + RMSNorm, argmax rows, SiLU-and-multiply, rotary + cache write, bf16 twins
 *   native_attention.c      decode attention over the paged cache in place, its split over long contexts
 *   native_gemv.c           the GEMV over fp32, int8, bf16 and another library's weights; the greedy LM head
 *   native_decode_layers.c  the fused decode layers (one OpenMP region; MKL's batched schedule)
 *
 * Built and loaded by kvbatch/kernels/cpu/native.py (ctypes, no torch headers); the build's key
 * (kvbatch/kernels/cpu/native_build.py) covers this file and every file it includes.
 */
#include "native_common.h"

int kvb_native_abi_version(void) { return 11; }
int kvb_block_cols(void) { return W_BLOCK; }

#include "native_small_ops.c"
#include "native_attention.c"
#include "native_gemv.c"
#include "native_decode_layers.c"
