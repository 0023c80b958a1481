/*
 * dd_copy_descs: one kernel launch copies a whole descriptor list on the GPU.
 *
 * Shipped as PTX, not compiled into the package: tools/copy_kernel.py (`make kernel`) runs
 * `nvcc -ptx` on this file and writes include/llm_datadist/dd_copy_kernel.h, which embeds the PTX
 * as a string. The cuda binding loads it at run time with cuModuleLoadData (the driver JIT-compiles
 * it for the GPU present), takes DD_COPY_KERNEL_NAME with cuModuleGetFunction and launches it with
 * cuLaunchKernel. The package itself needs neither nvcc nor a GPU to build.
 *
 * Parameters (cuLaunchKernel kernelParams: two pointers, to a device pointer and to an unsigned
 * long long):
 *   descs  device-readable array of `count` dd_copy_desc {uint64 src, dst, nbytes}, the layout of
 *          include/llm_datadist/dd_runtime.h (24 bytes each, no padding). src and dst are addresses
 *          the GPU can access (device memory, peer or IPC-mapped memory, pinned/registered host).
 *   count  number of descriptors; 0 copies nothing.
 *
 * Launch contract (host side):
 *   - blockDim = (DD_COPY_KERNEL_THREADS, 1, 1). The kernel strides by blockDim.x, so it stays
 *     correct for any block size up to DD_COPY_KERNEL_THREADS (its __launch_bounds__; a larger
 *     block fails at launch instead of copying wrongly), but it is tuned for exactly that many.
 *   - gridDim = (g, 1, 1), any g >= 1 (at most 2^31 - 1): block b copies descriptors b, b + g,
 *     b + 2g, ... (grid-stride). g = number of descriptors is the simplest choice; fewer blocks
 *     only means each walks more descriptors. With count == 0 launch nothing (a grid of 0 is a
 *     launch error, not an empty launch).
 *   - Split big copies: a descriptor of more than DD_COPY_KERNEL_PIECE_BYTES is handed over as
 *     pieces of DD_COPY_KERNEL_PIECE_BYTES (the last one shorter), piece k covering bytes
 *     [k * PIECE, min((k + 1) * PIECE, nbytes)). One block copies one descriptor, so without the
 *     split one 1 GiB descriptor would run on one SM while the others idle; with it every block
 *     has similar work. PIECE is a multiple of 16, so pieces keep the alignment of the original
 *     (and so its vector width). The kernel itself is correct for any nbytes, split or not.
 *   - Descriptors must not overlap another descriptor's destination (the order in which blocks
 *     run is not defined). Completion is the stream's: synchronize before reading dst.
 *
 * Inside one descriptor the block's threads copy units of 16 bytes (uint4) when src, dst and
 * nbytes are all multiples of 16, else of 8, else of 4, else single bytes: thread t copies units
 * t, t + blockDim.x, ..., DD_COPY_KERNEL_UNROLL of them loaded before any is stored, so several
 * loads are in flight per thread. Loads and stores use the .cg (cache at L2, not L1) operators:
 * every byte is read once, so L1 would only be polluted.
 *
 * Testing without a GPU: tests/core/test_copy_kernel.py compiles this very file with g++ as C++
 * after defining the CUDA keywords away and DD_COPY_LOAD / DD_COPY_STORE as checked accesses, runs
 * every (block, thread) of a launch in turn (the kernel has no shared memory and no barriers, so
 * any serial order is a valid schedule) and proves that every destination byte is written exactly
 * once, with the right value, by an access of the expected width and alignment, that nothing
 * outside the destinations is written and nothing outside the sources is read.
 */

/* The block size the host launches with (and the kernel's __launch_bounds__). */
#define DD_COPY_KERNEL_THREADS 256
/* The largest descriptor the host hands to the kernel; bigger copies are split (see above). */
#define DD_COPY_KERNEL_PIECE_BYTES (256u << 10)
/* Units each thread loads before storing them, per iteration. */
#define DD_COPY_KERNEL_UNROLL 4

#ifndef DD_COPY_LOAD
/* The unit at p[i], through L2 only. */
#define DD_COPY_LOAD(p, i) __ldcg((p) + (i))
#endif
#ifndef DD_COPY_STORE
/* Store v at p[i], cached at L2 only. */
#define DD_COPY_STORE(p, i, v) __stcg((p) + (i), (v))
#endif

/* Same layout as dd_copy_desc in include/llm_datadist/dd_runtime.h, redeclared so that this file
 * compiles alone (tools/copy_kernel.py passes nvcc no include path). */
struct dd_copy_desc {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long nbytes;
};

/* This block copies n units of T from src to dst. */
template <typename T>
static __device__ __forceinline__ void dd_copy_units(const T *src, T *dst, unsigned long long n)
{
    const unsigned long long step = blockDim.x;
    unsigned long long i = threadIdx.x;
    const unsigned long long span = (DD_COPY_KERNEL_UNROLL - 1) * step;
    if (n > span) {
        /* i < n - span  <=>  the last unit of this iteration, i + span, is < n */
        const unsigned long long end = n - span;
        for (; i < end; i += DD_COPY_KERNEL_UNROLL * step) {
            T unit[DD_COPY_KERNEL_UNROLL];
#pragma unroll
            for (int u = 0; u < DD_COPY_KERNEL_UNROLL; ++u)
                unit[u] = DD_COPY_LOAD(src, i + u * step);
#pragma unroll
            for (int u = 0; u < DD_COPY_KERNEL_UNROLL; ++u)
                DD_COPY_STORE(dst, i + u * step, unit[u]);
        }
    }
    for (; i < n; i += step)
        DD_COPY_STORE(dst, i, DD_COPY_LOAD(src, i));
}

extern "C" __global__ void __launch_bounds__(DD_COPY_KERNEL_THREADS)
dd_copy_descs(const dd_copy_desc *descs, unsigned long long count)
{
    for (unsigned long long k = blockIdx.x; k < count; k += gridDim.x) {
        const dd_copy_desc d = descs[k];
        /* The widest unit that src, dst and nbytes are all multiples of; the same for the whole
         * block, so the branch never diverges. */
        const unsigned long long align = d.src | d.dst | d.nbytes;
        if ((align & 15) == 0)
            dd_copy_units(reinterpret_cast<const uint4 *>(d.src), reinterpret_cast<uint4 *>(d.dst),
                          d.nbytes >> 4);
        else if ((align & 7) == 0)
            dd_copy_units(reinterpret_cast<const unsigned long long *>(d.src),
                          reinterpret_cast<unsigned long long *>(d.dst), d.nbytes >> 3);
        else if ((align & 3) == 0)
            dd_copy_units(reinterpret_cast<const unsigned int *>(d.src), reinterpret_cast<unsigned int *>(d.dst),
                          d.nbytes >> 2);
        else
            dd_copy_units(reinterpret_cast<const unsigned char *>(d.src),
                          reinterpret_cast<unsigned char *>(d.dst), d.nbytes);
    }
}
